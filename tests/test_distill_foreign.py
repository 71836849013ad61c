"""Teachers of another architecture (`bertforge.distill.foreign`): a transformers sequence classifier with no
task.json, run through transformers on bertforge's engines. Its outputs are transformers' own logits, its labels come
from its config in its own order, the outputs are cached like a bertforge teacher's, a student learns the task from it
alone, and what it cannot be (unnamed labels, pickled weights, another kind of task, no transformers) is one `error:`
line.

The teachers are tiny random-weight transformers models over conftest's whole-word vocabulary: a DistilBERT (an
architecture bertforge does not read) trained here on the keyword task of test_distill.py, with its labels in the
reverse of the task's order, and a transformers BERT for sentence pairs (its token types matter)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from infer_support import VOCAB
from safetensors.torch import load_file, save_file
from test_distill import OPTIONS, STUDENT_VOCAB, _model_dir, _one_error, _review, _write_task

from bertforge.distill import teacher as teacher_mod
from bertforge.distill.config import DistillConfig
from bertforge.distill.foreign import is_foreign
from bertforge.distill.run import distill
from bertforge.distill.teacher import teacher_outputs
from bertforge.options import DistillOptions
from bertforge.tasks import TextExample, get_task

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

LABELS = ["pos", "neg"]  # the teacher's order: the task's sorted labels are neg, pos


def _tokenizer(path: Path, cls):
    """transformers' WordPiece tokenizer over conftest's vocabulary (`vocab` in transformers 5, `vocab_file` before)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tokenizer = cls(vocab={w: i for i, w in enumerate(VOCAB)}, vocab_file=str(path / "vocab.txt"), do_lower_case=True)
    assert tokenizer.convert_ids_to_tokens(tokenizer("the film")["input_ids"]) == ["[CLS]", "the", "film", "[SEP]"]
    return tokenizer


def _distilbert(path: Path, seed: int = 0):
    config = transformers.DistilBertConfig(vocab_size=len(VOCAB), dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                           max_position_embeddings=64, id2label=dict(enumerate(LABELS)),
                                           label2id={label: i for i, label in enumerate(LABELS)})
    torch.manual_seed(seed)
    model = transformers.DistilBertForSequenceClassification(config)
    return model, _tokenizer(path, transformers.DistilBertTokenizerFast)


def _train(model, tokenizer, data: Path) -> float:
    """The teacher fitted to the task's train split (labels through its own label2id); its dev accuracy."""
    def split(name: str) -> tuple[list[str], torch.Tensor]:
        rows = [line.split(",") for line in (data / f"{name}.csv").read_text().splitlines()[1:]]
        return [r[0] for r in rows], torch.tensor([model.config.label2id[r[1]] for r in rows])

    texts, labels = split("train")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    model.train()
    for _ in range(8):
        order = list(range(len(texts)))
        rng.shuffle(order)
        for i in range(0, len(order), 16):
            rows = order[i:i + 16]
            batch = tokenizer([texts[r] for r in rows], padding=True, return_tensors="pt")
            loss = model(**batch, labels=labels[rows]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    texts, labels = split("dev")
    with torch.no_grad():
        predicted = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.argmax(-1)
    return float((predicted == labels).float().mean()) * 100


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("foreign")
    data = _write_task(root / "data")
    teacher = root / "teacher"
    model, tokenizer = _distilbert(teacher)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        accuracy = _train(model, tokenizer, data)
    finally:
        torch.set_num_threads(before)
    assert accuracy >= 95.0
    model.save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    rng = random.Random(1)
    corpus = root / "reviews.txt"
    corpus.write_text("\n\n".join(f"{_review(rng, rng.random() < 0.5)}." for _ in range(150)))
    return {"data": data, "teacher": teacher, "student": _model_dir(STUDENT_VOCAB, root / "student", 1),
            "corpus": corpus, "model": model, "tokenizer": tokenizer}


def _config(setup: dict, tmp_path: Path, **fields) -> DistillConfig:
    values = {"teacher": setup["teacher"], "student": setup["student"], "task": "csv", "data_dir": setup["data"],
              "out_dir": tmp_path / "out", "options": OPTIONS, "cache_dir": tmp_path / "cache", **fields}
    return DistillConfig(**values)


def test_a_transformers_classifier_without_task_json_is_a_foreign_teacher(setup, tmp_path):
    assert is_foreign(setup["teacher"]) and not is_foreign(setup["student"])  # the student: a BERT masked LM
    (tmp_path / "task.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    assert not is_foreign(tmp_path)  # bertforge's own fine-tuned directory


def test_its_outputs_are_transformers_own_logits_in_its_label_order(setup, tmp_path):
    examples = [TextExample(id=str(i), text=t) for i, t in enumerate(["the film was good", "awful plot", "bad",
                                                                      "the story was great and the acting good"])]
    task = get_task("csv", labels=LABELS)
    outputs = teacher_outputs(setup["teacher"], examples, DistillOptions(teacher_engine="fp32"), task=task,
                              device="cpu", cache=tmp_path, progress=False)
    with torch.no_grad():
        expected = [setup["model"](**setup["tokenizer"](ex.text, return_tensors="pt")).logits[0].numpy()
                    for ex in examples]
    np.testing.assert_allclose(np.stack(outputs.outputs), np.stack(expected), atol=1e-4)
    assert [LABELS[int(np.argmax(o))] for o in outputs.outputs] == ["pos", "neg", "neg", "pos"]
    assert outputs.manifest["labels"] == LABELS and outputs.manifest["engine"]["runtime"] == "transformers"
    int8 = teacher_outputs(setup["teacher"], examples, DistillOptions(teacher_engine="int8"), task=task,
                           cache=tmp_path, progress=False)
    assert int8.key != outputs.key and not int8.cached
    assert [int(np.argmax(o)) for o in int8.outputs] == [int(np.argmax(o)) for o in outputs.outputs]
    np.testing.assert_allclose(np.stack(int8.outputs), np.stack(outputs.outputs), atol=0.25)


def test_sentence_pairs_reach_the_teacher_with_their_token_types(tmp_path):
    path = tmp_path / "bert"
    tokenizer = _tokenizer(path, transformers.BertTokenizerFast)
    config = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                     id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1})
    torch.manual_seed(3)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight[1] += 2.0  # so that token types change the logits
        model.classifier.weight *= 300  # logits of order 1, not 0.01
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    examples = [TextExample(id="0", text="the film", text_pair="was good"),
                TextExample(id="1", text="a quick brown fox jumps over the lazy dog", text_pair="bad")]
    outputs = teacher_outputs(path, examples, DistillOptions(teacher_engine="fp32"), task=get_task("csv", labels=[
        "neg", "pos"]), device="cpu", cache=tmp_path / "cache", progress=False).outputs
    with torch.no_grad():
        expected = [model(**tokenizer(ex.text, ex.text_pair, return_tensors="pt")).logits[0].numpy()
                    for ex in examples]
        untyped = model(**{k: v for k, v in tokenizer(examples[0].text, examples[0].text_pair,
                                                      return_tensors="pt").items() if k != "token_type_ids"})
    np.testing.assert_allclose(np.stack(outputs), np.stack(expected), atol=1e-4)
    assert np.abs(outputs[0] - untyped.logits[0].numpy()).max() > 0.01, (outputs[0], untyped.logits[0])  # 100x atol


def test_a_student_learns_the_task_from_a_foreign_teacher_alone(setup, tmp_path, monkeypatch):
    config = _config(setup, tmp_path, transfer=(str(setup["corpus"]),)).with_distill(alpha=0.0)
    result = distill(config)
    assert result["metrics"]["accuracy"] >= 90.0, result["history"]  # the labels' order reversed: 10 or less
    recorded = json.loads((tmp_path / "out" / "run_config.json").read_text())
    assert recorded["teacher"]["dir"] == str(setup["teacher"])
    monkeypatch.setattr(teacher_mod, "run_foreign", lambda *a, **k: pytest.fail("the teacher ran again"))
    again = distill(config.replace(out_dir=tmp_path / "again").with_options(epochs=0.25))
    assert again["teacher"]["cached"] and again["teacher"]["outputs"] == result["teacher"]["outputs"]


def test_what_a_foreign_teacher_cannot_be_is_one_error_line(setup, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    base = ["--student", setup["student"], "--task", "csv", "--data", setup["data"], "--out", out, "--cache-dir",
            tmp_path / "cache", "--no-progress"]
    generic = tmp_path / "generic"
    model, tokenizer = _distilbert(generic)
    model.config.id2label, model.config.label2id = {0: "LABEL_0", 1: "LABEL_1"}, {"LABEL_0": 0, "LABEL_1": 1}
    model.save_pretrained(generic)
    tokenizer.save_pretrained(generic)
    capsys.readouterr()  # transformers' progress bar as it saved
    assert "not the task's" in _one_error(capsys, ["--teacher", generic, *base])  # LABEL_0, LABEL_1, or none saved
    other = _write_task(tmp_path / "other-labels", labels=("neg", "neutral"))
    assert "lack neutral" in _one_error(capsys, ["--teacher", setup["teacher"], *base[:4], "--data", other, *base[6:]])
    assert "preset student" in _one_error(capsys, ["--teacher", setup["teacher"], *base[2:], "--student", "tiny"])
    assert "classification and regression" in _one_error(capsys, ["--teacher", setup["teacher"], *base[:2],
                                                                  "--task", "conll2003", *base[4:]])
    pickled = tmp_path / "pickled"
    model, tokenizer = _distilbert(pickled)
    model.save_pretrained(pickled)
    tokenizer.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")  # the weights as a pickle alone
    (pickled / "model.safetensors").unlink()
    capsys.readouterr()
    assert "never unpickles" in _one_error(capsys, ["--teacher", pickled, *base])
    headless = tmp_path / "headless"
    model, tokenizer = _distilbert(headless)
    model.save_pretrained(headless)
    tokenizer.save_pretrained(headless)
    weights = load_file(headless / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("classifier.")}, headless / "model.safetensors")
    capsys.readouterr()
    assert "lacks weights (classifier.bias, classifier.weight)" in _one_error(capsys, ["--teacher", headless, *base])
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    assert "bertforge[teachers]" in _one_error(capsys, ["--teacher", setup["teacher"], *base])
    assert not out.exists() and not (tmp_path / "out.partial").exists()
