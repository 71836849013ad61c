"""Distillation's other paths: two processes as ranks of one group (one process's student, the teacher run once on
the main process and read from the cache by the others), the student's directory in transformers and ONNX with the
logits of `bertforge predict`, multiple choice (swag) and tagging (conll2003) end to end.

The teacher, the student's vocabulary and the keyword task are tests/test_distill.py's."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import forked_ranks
from infer_support import VOCAB, save
from safetensors.torch import load_file
from test_distill import ARGS, OPTIONS, SIZES, STUDENT_VOCAB, _config, _model_dir, setup  # noqa: F401 (setup: fixture)

from bertforge import BertConfig
from bertforge.cli import main
from bertforge.distill.config import DistillConfig
from bertforge.distill.run import distill
from bertforge.files import read_jsonl
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.run import finetune
from bertforge.infer import predict_records
from bertforge.models import BertForMaskedLM
from bertforge.options import DistillOptions, FinetuneOptions
from bertforge.tasks.runner import load_task_model
from bertforge.tokenizer import Tokenizer

# slow: each test trains a teacher or a student, or two ranks
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

def _counting_teacher(calls: Path) -> None:
    """In a rank: each call of the teacher logged, as the rank that made it, in `calls`."""
    from bertforge.distill import teacher

    real = teacher.run_teacher

    def counted(*args, **kwargs):
        with open(calls, "a") as f:
            f.write(os.environ["RANK"] + "\n")
        return real(*args, **kwargs)

    teacher.run_teacher = counted


def _no_dropout_student(path: Path) -> Path:
    """The student of test_distill without dropout, so one process and two draw nothing that differs."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = BertForMaskedLM(BertConfig(vocab_size=len(STUDENT_VOCAB), hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0, **SIZES))
    return save(model, Tokenizer(STUDENT_VOCAB, lowercase=True), path)


# --- two ranks ---------------------------------------------------------------------------------------------------


def test_two_processes_distil_the_student_one_process_does_with_the_teacher_run_once(setup, tmp_path):  # noqa: F811
    """The same distillation (labels and transfer texts in every batch) in one process and in two: the same global
    batches (one process's in two micro-batches of 4, as two processes cut them) with exact per-term weighting give
    the same losses, weights and dev figures up to float summation order. In two, the main process labels the
    examples and the other reads its outputs from the cache: the teacher runs once, on rank 0, its outputs those one
    process computed, and only rank 0 reports."""
    student = _no_dropout_student(tmp_path / "student")
    config = _config(setup, tmp_path, student=student, transfer=(str(setup["corpus"]),), out_dir=tmp_path / "one",
                     cache_dir=tmp_path / "cache-one")
    one = distill(config.with_options(micro_batch_size=4, epochs=4.0))
    calls = tmp_path / "teacher-calls"
    argv = ["distill", "--teacher", setup["teacher"], "--student", student, "--data", setup["data"],
            "--transfer-corpus", setup["corpus"], "--cache-dir", tmp_path / "cache-two", *ARGS, "--epochs", "4",
            "--out", tmp_path / "two"]
    run = forked_ranks(argv, tmp_path / "logs", before=lambda: _counting_teacher(calls))
    assert run.returncode == 0, run.stderr[-3000:]
    assert calls.read_text().split() == ["0"]  # labelled once, by the main process
    assert run.stdout.count("(computed; 150 transfer texts)") == run.stdout.count("model saved to") == 1, run.stdout
    assert not (tmp_path / "two.partial").exists()

    [entry] = (p for p in (tmp_path / "cache-two").iterdir() if p.name != "transfer-sets")
    assert entry.name == one["teacher"]["outputs"]
    np.testing.assert_array_equal(np.load(entry / "logits.npy"),
                                  np.load(tmp_path / "cache-one" / entry.name / "logits.npy"))
    records = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("one", "two")}
    for term in ("distill_loss", "task_loss"):
        la, lb = ([r[term] for r in records[name] if r["split"] == "train"] for name in ("one", "two"))
        assert len(la) == len(lb) > 4 and la == pytest.approx(lb, abs=1e-4), term
    # the objective falls (its terms need not each: a student growing sure of the labels can move away from a
    # teacher that is unsure of them, as this toy one is)
    total = [r["distill_loss"] + r["task_loss"] for r in records["one"] if r["split"] == "train"]
    assert total[-1] < total[0]
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)
    reported = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert reported["metrics"] == pytest.approx(one["metrics"]) and reported["best_step"] == one["best_step"]
    assert reported["metrics"]["accuracy"] >= 90.0, reported["history"]
    recorded = json.loads((tmp_path / "two" / "run_config.json").read_text())
    assert recorded["command"] == "distill" and recorded["teacher"]["outputs"] == entry.name


# --- the student's directory elsewhere --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def student_dir(setup, tmp_path_factory) -> Path:  # noqa: F811
    """A student of another vocabulary distilled for one epoch."""
    tmp = tmp_path_factory.mktemp("student")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        distill(_config(setup, tmp).with_options(epochs=1.0))
    finally:
        torch.set_num_threads(before)
    return tmp / "out"


TEXTS = ["the dog was great", "the plot was awful and the acting bad", "a film", "it was good , the story of a fox"]


def test_transformers_loads_the_student_with_the_logits_of_bertforge(student_dir):
    transformers = pytest.importorskip("transformers", reason="transformers (the reference) is a test dependency")
    hf, info = transformers.BertForSequenceClassification.from_pretrained(student_dir, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert hf.config.id2label == {0: "neg", 1: "pos"}
    tm = load_task_model(student_dir, device="cpu")
    records = predict_records(student_dir, [{"text": t} for t in TEXTS])
    for text, record in zip(TEXTS, records, strict=True):
        ids = torch.tensor([tm.tokenizer.encode(text, max_length=tm.max_length).ids])
        with torch.no_grad():
            theirs, ours = hf.eval()(input_ids=ids).logits[0], tm.model(ids).logits[0]
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
        p = theirs.softmax(-1)
        np.testing.assert_allclose([record["probabilities"]["neg"], record["probabilities"]["pos"]], p, atol=1e-5)
        assert record["label"] == hf.config.id2label[int(p.argmax())]


def test_the_student_exports_to_onnx_with_its_logits(student_dir, tmp_path, capsys):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install bertforge[onnx])")
    assert main(["export", "--format", "onnx", "--model", str(student_dir), "--out", str(tmp_path / "s.onnx")]) == 0
    capsys.readouterr()
    session = ort.InferenceSession(str(tmp_path / "s.onnx"), providers=["CPUExecutionProvider"])
    tm = load_task_model(student_dir, device="cpu")
    ids = torch.tensor([tm.tokenizer.encode(TEXTS[1], max_length=tm.max_length).ids])
    feeds = {"input_ids": ids.numpy(), "token_type_ids": np.zeros_like(ids.numpy()),
             "attention_mask": np.ones_like(ids.numpy())}
    [got] = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
    with torch.no_grad():
        np.testing.assert_allclose(got, tm.model(ids).logits.numpy(), atol=1e-4)


# --- multiple choice ----------------------------------------------------------------------------------------------

SWAG_HEADER = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1",
               "ending2", "ending3", "label"]
FILLER = ["the", "film", "plot", "story", "dog", "fox", "was", "it", "and", "of", "a"]


def _write_swag(root: Path, n_train: int = 96, seed: int = 0) -> Path:
    """A choice task: the ending with "great" or "good" is right, the three others have "bad" or "awful"."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.csv", n_train), ("val.csv", 32)):
        rows = []
        for i in range(n):
            endings = [" ".join([*rng.sample(FILLER, 3), rng.choice(["bad", "awful"])]) for _ in range(4)]
            label = rng.randrange(4)
            endings[label] = " ".join([*rng.sample(FILLER, 3), rng.choice(["good", "great"])])
            context = " ".join(rng.sample(FILLER, 4))
            rows.append([str(i), "v", str(i), context, context, "it", "gold", *endings, str(label)])
        with open(root / name, "w", newline="") as f:
            csv.writer(f).writerows([SWAG_HEADER, *rows])
    return root


def _teach_and_distil(tmp_path: Path, task: str, write, epochs: float) -> tuple[dict, dict, list[float]]:
    """A teacher fine-tuned on `task` (data by `write(root, n_train, seed)`), then a student over the other vocabulary
    distilled from its outputs alone (alpha 0) for `epochs`: the two results and the student's distillation losses.

    The teacher trains one epoch on many examples: over several epochs its dev score reaches its top early, and of
    equal scores the first model is kept, whose outputs are nearly uniform (a poor teacher)."""
    options = FinetuneOptions(lr=3e-3, epochs=1, batch_size=8, max_length=16, progress=False)
    teacher = finetune(FinetuneConfig(task=task, data_dir=write(tmp_path / "many", 480, seed=1),
                                      init=_model_dir(VOCAB, tmp_path / "init", 0), out_dir=tmp_path / "teacher",
                                      options=options))
    student = dataclasses.replace(OPTIONS, epochs=epochs, max_length=48)  # words in letters: longer inputs
    result = distill(DistillConfig(teacher=tmp_path / "teacher", student=_model_dir(STUDENT_VOCAB, tmp_path / "s", 1),
                                   task=task, data_dir=write(tmp_path / "data", 96, seed=0), out_dir=tmp_path / "out",
                                   cache_dir=tmp_path / "cache", options=student, distill=DistillOptions(alpha=0.0)))
    losses = [r["distill_loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if r["split"] == "train"]
    return teacher, result, losses


def test_multiple_choice_distils_each_examples_choice_scores(tmp_path):
    teacher, student, losses = _teach_and_distil(tmp_path, "swag", _write_swag, epochs=3.0)
    assert teacher["metrics"]["accuracy"] >= 90.0, teacher["history"]
    assert student["metrics"]["accuracy"] >= 90.0, student["history"]  # chance: 25
    assert losses[-1] < losses[0] / 2, losses
    tm = load_task_model(tmp_path / "out")
    assert tm.task.kind == "multiple_choice" and tm.tokenizer.vocab == STUDENT_VOCAB


# --- tagging ------------------------------------------------------------------------------------------------------

WHOLE = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "that", "film", "movie"]  # whole in both vocabularies


def _write_conll(root: Path, n_train: int = 96, seed: int = 0) -> Path:
    """A tagging task: john and smith are people, paris a place, among words both tokenizers keep whole (the student
    cuts the names into letters)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)

    def sentence() -> str:
        tags = {"john": "B-PER", "smith": "B-PER", "paris": "B-LOC"}
        words = [rng.choice(list(tags)) if rng.random() < 0.3 else rng.choice(WHOLE) for _ in range(6)]
        return "\n".join(f"{w} NN B-NP {tags.get(w, 'O')}" for w in words)

    for name, n in (("train.txt", n_train), ("valid.txt", 32)):
        (root / name).write_text("-DOCSTART- -X- -X- O\n\n" + "\n\n".join(sentence() for _ in range(n)) + "\n")
    return root


def test_tagging_distils_per_word_across_tokenizers(tmp_path):
    """The teacher reads each word whole, the student the names in letters: it learns the entities from the teacher's
    outputs on each word's first sub-token alone."""
    teacher, student, losses = _teach_and_distil(tmp_path, "conll2003", _write_conll, epochs=4.0)
    assert teacher["metrics"]["f1"] >= 95.0, teacher["history"]
    assert student["metrics"]["f1"] >= 90.0, student["history"]  # f1 0 before it learns
    assert losses[-1] < losses[0] / 2, losses
