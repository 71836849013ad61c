"""Distillation (`bertforge distill`): the loss against a hand computation, the teacher's outputs cached and reused,
the transfer set, a student with another vocabulary learning from the teacher alone, its output loading as any
fine-tuned model, resume after a kill to the same bits, and bad input refused in one `error:` line.

The teacher is a tiny BERT over conftest's whole-word vocabulary fine-tuned on a keyword task; the student a tiny
BERT over a vocabulary of its own (other ids, most words cut into letters), so every test that trains crosses
tokenizers."""

from __future__ import annotations

import csv
import dataclasses
import json
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from forked import Forked, kill_at
from infer_support import VOCAB, WORDS, save
from safetensors.torch import load_file, save_file
from simulated_clock import simulated_clock

from bertforge import BertConfig
from bertforge.cli import main
from bertforge.distill import run as distill_run
from bertforge.distill import teacher as teacher_mod
from bertforge.distill.config import DistillConfig
from bertforge.distill.objective import DistillObjective, distill_batch, distill_losses, soft_kl, with_targets
from bertforge.distill.run import distill, teacher_pass
from bertforge.distill.teacher import cache_key, teacher_outputs
from bertforge.distill.transfer import median_words, most_like, snippets, transfer_texts
from bertforge.errors import BertforgeError
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.run import finetune
from bertforge.models import BertForMaskedLM
from bertforge.options import DistillOptions, FinetuneOptions
from bertforge.pretrain.budget import TIMED_STEPS
from bertforge.tasks import IGNORE_INDEX, TaggedExample, TextExample, get_task
from bertforge.tasks.runner import load_task_model
from bertforge.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
         "max_position_embeddings": 64}
LETTERS = sorted(set("".join(WORDS)) - set(",.?!'"))
# the student's vocabulary: a few words, in another order than the teacher's, and letters for the rest
STUDENT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *reversed(WORDS[:12]), *LETTERS,
                 *[f"##{c}" for c in LETTERS], ",", ".", "?", "!", "'"]
FILLER = ["the", "film", "movie", "plot", "acting", "story", "dog", "fox", "was", "it", "and", "of"]
# the student's training: ARGS on the command line are OPTIONS in the library
OPTIONS = FinetuneOptions(lr=3e-3, epochs=2.0, batch_size=8, max_length=32, eval_batch_size=16, save_every=6,
                          progress=False)
ARGS = ["--task", "csv", "--lr", "3e-3", "--epochs", "2", "--batch-size", "8", "--max-length", "32",
        "--eval-batch-size", "16", "--save-every", "6", "--no-progress"]


def _model_dir(vocab: list[str], path: Path, seed: int) -> Path:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = BertForMaskedLM(BertConfig(vocab_size=len(vocab), **SIZES))
    return save(model, Tokenizer(vocab, lowercase=True), path)


def _review(rng: random.Random, positive: bool) -> str:
    words = [rng.choice(FILLER) for _ in range(5)] + [rng.choice(["good", "great"] if positive else ["bad", "awful"])]
    rng.shuffle(words)
    return " ".join(words)


def _write_task(root: Path, n_train: int = 96, labels: tuple[str, str] = ("neg", "pos")) -> Path:
    """A keyword task: good/great -> pos, bad/awful -> neg, among filler words."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("dev", 32)):
        rows = [["text", "label"]] + [[_review(rng, i % 2 == 1), labels[i % 2]] for i in range(n)]
        with open(root / f"{split}.csv", "w", newline="") as f:
            csv.writer(f).writerows(rows)
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """The task's data, a fine-tuned teacher (100% on dev), a student over another vocabulary, a transfer corpus."""
    root = tmp_path_factory.mktemp("distill")
    data = _write_task(root / "data")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = finetune(FinetuneConfig(task="csv", data_dir=data, init=_model_dir(VOCAB, root / "init", 0),
                                         out_dir=root / "teacher", options=FinetuneOptions(
                                             lr=3e-3, epochs=6, batch_size=8, max_length=16, progress=False)))
    finally:
        torch.set_num_threads(before)
    assert result["metrics"]["accuracy"] >= 95.0
    rng = random.Random(1)
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "reviews.txt").write_text("\n\n".join(f"{_review(rng, rng.random() < 0.5)}." for _ in range(150)))
    return {"data": data, "teacher": root / "teacher", "student": _model_dir(STUDENT_VOCAB, root / "student", 1),
            "corpus": corpus}


def _config(setup: dict, tmp_path: Path, **fields) -> DistillConfig:
    values = {"teacher": setup["teacher"], "student": setup["student"], "task": "csv", "data_dir": setup["data"],
              "out_dir": tmp_path / "out", "options": OPTIONS, "cache_dir": tmp_path / "cache", **fields}
    return DistillConfig(**values)


# --- the loss ------------------------------------------------------------------------------------------------


def test_at_temperature_1_a_one_hot_teacher_gives_the_cross_entropy():
    student = torch.randn(6, 3)
    labels = torch.tensor([0, 2, 1, 1, 0, 2])
    one_hot = torch.full((6, 3), -torch.inf).scatter(1, labels[:, None], 0.0)
    assert torch.allclose(soft_kl(student, one_hot, 1.0).mean(), F.cross_entropy(student, labels))


def test_the_loss_terms_match_a_hand_computation():
    rng = np.random.default_rng(0)
    z, t = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    labels = np.array([2, IGNORE_INDEX, 0, IGNORE_INDEX])

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(t / 2), softmax(z / 2)
    kl = 4 * (p * (np.log(p) - np.log(q))).sum(-1).mean()
    ce = -np.mean([np.log(softmax(z)[i, labels[i]]) for i in (0, 2)])  # the labelled examples only
    got = distill_losses(torch.tensor(z), torch.tensor(t), torch.tensor(labels), kind="classification",
                         temperature=2.0, alpha=0.3)
    assert got["distill"].item() == pytest.approx(kl, rel=1e-5)
    assert got["task"].item() == pytest.approx(0.3 * ce, rel=1e-5)
    unlabelled = distill_losses(torch.tensor(z), torch.tensor(t), torch.full((4,), IGNORE_INDEX), kind="classification",
                                temperature=2.0, alpha=0.3)
    assert unlabelled["task"].item() == 0.0  # not NaN: a batch of transfer texts weighs nothing in the step
    reg = distill_losses(torch.tensor([[1.0], [2.0]]), torch.tensor([[0.5], [2.5]]), torch.tensor([3.0, float("nan")]),
                         kind="regression", temperature=2.0, alpha=0.5)
    assert reg["distill"].item() == pytest.approx(0.25) and reg["task"].item() == pytest.approx(0.5 * 4.0)


def test_tagging_distils_each_word_on_its_first_sub_token_whatever_the_tokenizer():
    task = get_task("conll2003")
    example = TaggedExample(id="0", words=["john", "smith", "lives", "in", "paris"], tags=["B-PER", "I-PER", "O",
                                                                                              "O", "B-LOC"])
    task.label_list([example])
    student = Tokenizer(STUDENT_VOCAB, lowercase=True)  # "john" and "paris" are letters here, "smith" too
    features = task.features([example], student, 32, task.label_map())
    words = np.arange(5 * 9, dtype=np.float32).reshape(5, 9)  # word w's teacher logits: 9w .. 9w + 8
    words[3] = np.nan  # a word the teacher's tokenizer dropped
    [f] = with_targets(features, [words], "token_classification")
    firsts = [p for p, w in enumerate(f["word_ids"]) if w is not None and f["word_ids"][p - 1] != w]
    assert len(f["input_ids"]) > 7 and len(firsts) == 5  # the words are cut into several pieces
    for p, w in enumerate(f["word_ids"]):
        expected = words[w] if p in firsts and w != 3 else np.full(9, np.nan)
        np.testing.assert_array_equal(f["teacher"][p], expected)
    assert [f["labels"][p] for p in firsts] == [task.label_map()[t] for t in example.tags]
    batch = distill_batch([f, f], student.pad_id)
    objective = DistillObjective("token_classification", 2.0, 1.0)
    assert objective.counts(batch) == {"distill": 8, "task": 10}  # the dropped word has a label, no teacher target


# --- the teacher's outputs -------------------------------------------------------------------------------------


def _counting(monkeypatch) -> list:
    calls: list = []
    real = teacher_mod.run_teacher

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(teacher_mod, "run_teacher", counted)
    return calls


def test_the_teacher_runs_once_and_a_changed_teacher_or_text_is_another_entry(setup, tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    examples = [TextExample(id=str(i), text=_review(random.Random(i), i % 2 == 1)) for i in range(20)]
    options, cache = DistillOptions(teacher_engine="fp32"), tmp_path / "cache"
    first = teacher_outputs(setup["teacher"], examples, options, cache=cache, progress=False)
    again = teacher_outputs(setup["teacher"], examples, options, cache=cache, progress=False)
    assert (first.cached, again.cached, len(calls)) == (False, True, 1)
    assert first.key == again.key == cache_key(first.manifest) and (cache / first.key / "manifest.json").is_file()
    np.testing.assert_array_equal(np.stack(first.outputs), np.stack(again.outputs))
    assert np.stack(first.outputs).argmax(1).tolist() == [i % 2 for i in range(20)]  # the teacher is right
    moved = tmp_path / "moved-teacher"  # the same teacher elsewhere: the same entry
    shutil.copytree(setup["teacher"], moved)
    assert teacher_outputs(moved, examples, options, cache=cache, progress=False).cached
    other_text = teacher_outputs(setup["teacher"], examples[:-1], options, cache=cache, progress=False)
    weights = moved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    other_teacher = teacher_outputs(moved, examples, options, cache=cache, progress=False)
    assert len({first.key, other_text.key, other_teacher.key}) == 3 and len(calls) == 3
    (cache / first.key / "logits.npy").write_bytes((cache / first.key / "logits.npy").read_bytes()[:100])  # cut short
    assert not teacher_outputs(setup["teacher"], examples, options, cache=cache, progress=False).cached
    assert len(calls) == 4
    manifest = cache / first.key / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"examples": 20', '"examples": 21'))  # edited
    assert not teacher_outputs(setup["teacher"], examples, options, cache=cache, progress=False).cached


# --- the transfer set --------------------------------------------------------------------------------------------


def test_transfer_snippets_are_sized_deduplicated_and_chosen_by_the_seed(tmp_path):
    sentences = ["one two three.", "four five.", "six seven eight nine ten eleven twelve thirteen.", "end."]
    assert list(snippets(sentences, 5)) == ["one two three. four five.", "six seven eight nine ten",
                                            "eleven twelve thirteen. end."]
    assert median_words(["a b", "a b c", "a b c d e f"]) == 3
    corpus = tmp_path / "corpus.jsonl"
    docs = [" ".join(f"Sentence {d} {i}." for i in range(6)) for d in range(50)] + ["Sentence 0 0.  Sentence 0 1."] * 5
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    every = transfer_texts([str(corpus)], words=6, limit=10**6, seed=0, exclude=["Sentence 1 0. Sentence 1 1."])
    assert all(len(t.split()) <= 6 for t in every) and len(every) == len(set(every)) == 149  # 150, one excluded
    some = transfer_texts([str(corpus)], words=6, limit=20, seed=0)
    assert len(some) == 20 and some == transfer_texts([str(corpus)], words=6, limit=20, seed=0)
    assert set(some) <= set(every) | {"Sentence 1 0. Sentence 1 1."}
    assert some == sorted(some, key=lambda t: (int(t.split()[1]), int(t.split()[2][:-1])))  # in corpus order
    assert some != transfer_texts([str(corpus)], words=6, limit=20, seed=1)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(BertforgeError, match="holds no text"):
        transfer_texts([str(tmp_path / "empty.txt")], words=6, limit=10, seed=0)


def _verdicts_and_plots(n: int) -> tuple[list[str], list[str]]:
    """n distinct snippets that judge a film as the task's texts do and n that retell a plot, in one corpus order."""
    rng = random.Random(3)
    verdict = ["a {} and {} film", "{} acting, {} script", "the most {} comedy in years, and {}"]
    plot = ["then the {} sister drives to {} to find the letter", "the {} detective meets {} at the harbour"]
    judged = ["moving", "tedious", "sharp", "clumsy", "wonderful", "dull", "witty", "bloated"]
    things = ["old", "young", "Paris", "Rome", "the captain", "Maria", "second", "quiet"]
    made = [(rng.choice(verdict).format(*rng.sample(judged, 2)) + f" {k}", True) for k in range(n)]
    made += [(rng.choice(plot).format(*rng.sample(things, 2)) + f" {k}", False) for k in range(n)]
    rng.shuffle(made)
    return [t for t, _ in made], [t for t, is_verdict in made if is_verdict]


def test_the_snippets_most_like_the_tasks_texts_are_kept_in_corpus_order():
    candidates, verdicts = _verdicts_and_plots(200)
    task = [f"{a} and {b}, a {c} picture" for a, b, c in zip(["witty", "dull"] * 20, ["sharp", "tedious"] * 20,
                                                                   ["moving", "clumsy"] * 20, strict=True)]
    kept = most_like(task, candidates, 150, seed=0)
    assert len(kept) == 150 and set(kept) <= set(verdicts)  # 150 of the 200 verdicts, no plot
    assert kept == [t for t in candidates if t in set(kept)]  # in the corpus's order
    assert kept == most_like(task, candidates, 150, seed=0)
    assert most_like(task, candidates[:100], 150, seed=0) == candidates[:100]  # no more than asked: all of them
    assert len(most_like(["1 2", "3"], ["4 5", "6", "7 8"], 2, seed=0)) == 2  # no words to compare: a sample


def test_the_run_selects_its_transfer_set_as_asked(setup, tmp_path):
    """A corpus of the task's kind of text (reviews) and plot summaries: task-like (the default) keeps the reviews,
    random both."""
    rng = random.Random(4)
    plots = [f"then the {rng.choice(['old', 'young'])} sister drives to {c} {k}" for k, c in enumerate(
        rng.choices(["Paris", "Rome", "Oslo"], k=100))]
    reviews = [f"{_review(rng, rng.random() < 0.5)} {k}" for k in range(100)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in rng.sample(plots + reviews, 200)))
    task = get_task("csv")
    train = task.read_train(str(setup["data"]), None)
    options = DistillOptions(max_transfer_texts=60, transfer_words=20)
    config = _config(setup, tmp_path, transfer=(str(corpus),), distill=options)
    like = [ex.text for ex in distill_run._transfer(config, task, train)]
    sampled = [ex.text for ex in distill_run._transfer(config.with_distill(transfer_select="random"), task, train)]
    assert len(like) == len(sampled) == 60 and set(like) <= set(reviews)
    assert sum(t in reviews for t in sampled) < 50  # a uniform sample: about half of each
    with pytest.raises(BertforgeError, match="--transfer-select 'plots': give one of random, task-like"):
        config.with_distill(transfer_select="plots")


def test_the_chosen_transfer_set_is_kept_and_a_changed_corpus_or_setting_chosen_again(setup, tmp_path, monkeypatch):
    rng = random.Random(5)
    corpus = tmp_path / "corpus" / "reviews.txt"
    corpus.parent.mkdir()
    corpus.write_text("\n\n".join(f"{_review(rng, rng.random() < 0.5)} {k}." for k in range(120)))
    task = get_task("csv")
    train = task.read_train(str(setup["data"]), None)
    config = _config(setup, tmp_path, transfer=(str(corpus),), distill=DistillOptions(max_transfer_texts=30))
    calls: list = []
    real = distill_run.transfer_texts
    monkeypatch.setattr(distill_run, "transfer_texts", lambda *a, **k: calls.append(1) or real(*a, **k))

    def chosen(c: DistillConfig) -> list[str]:
        return [ex.text for ex in distill_run._transfer(c, task, train)]
    first = chosen(config)
    assert chosen(config) == first and len(first) == 30 and len(calls) == 1  # read back, not chosen again
    (entry,) = (tmp_path / "cache" / "transfer-sets").iterdir()
    assert entry.read_text(encoding="utf-8").split("\n") == first
    elsewhere = tmp_path / "copy" / "reviews.txt"  # the same bytes under the same name elsewhere: the same set
    elsewhere.parent.mkdir()
    shutil.copy(corpus, elsewhere)
    assert chosen(dataclasses.replace(config, transfer=(str(elsewhere),))) == first and len(calls) == 1
    assert len(chosen(config.with_distill(transfer_select="random"))) == 30 and len(calls) == 2
    corpus.write_text("\n\n".join(f"{_review(rng, rng.random() < 0.5)} {k}." for k in range(500, 620)))
    changed = chosen(config)
    assert len(calls) == 3 and not set(changed) & set(first) and len(changed) == 30


# --- runs ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def distilled(setup, tmp_path_factory) -> dict:
    """A student over another vocabulary, distilled from the teacher's outputs alone (alpha 0) on the transfer set
    and the task's texts, through the library; the reference the resumed runs must equal."""
    tmp = tmp_path_factory.mktemp("distilled")
    config = _config(setup, tmp, transfer=(str(setup["corpus"]),), distill=DistillOptions(alpha=0.0))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = distill(config)
    finally:
        torch.set_num_threads(before)
    return {"config": config, "result": result, "out": tmp / "out"}


def test_a_student_of_another_vocabulary_learns_from_the_teacher_alone(distilled):
    result = distilled["result"]
    assert result["metrics"]["accuracy"] >= 90.0, result["history"]  # chance: 50
    assert result["teacher"]["transfer_texts"] > 100 and not result["teacher"]["cached"]
    logged = [json.loads(line) for line in (distilled["out"] / "metrics.jsonl").read_text().splitlines()]
    losses = [r["distill_loss"] for r in logged if r["split"] == "train"]
    assert losses[-1] < losses[0] / 2, losses
    assert all(r["task_loss"] == 0.0 for r in logged if r["split"] == "train")  # alpha 0


def test_the_student_is_an_ordinary_fine_tuned_model(distilled, capsys):
    out = distilled["out"]
    tm = load_task_model(out)
    assert tm.tokenizer.vocab == STUDENT_VOCAB and tm.model.config.labels == ["neg", "pos"]
    recorded = json.loads((out / "run_config.json").read_text())
    assert recorded["command"] == "distill" and recorded["teacher"]["outputs"] == distilled["result"]["teacher"][
        "outputs"]
    assert recorded["options"]["temperature"] == 2.0 and recorded["options"]["alpha"] == 0.0
    assert main(["predict", "--model", str(out), "--text", "the dog was great", "the plot was awful"]) == 0
    predicted = [json.loads(line)["label"] for line in capsys.readouterr().out.splitlines()]
    assert predicted == ["pos", "neg"]


def test_a_repeated_run_does_not_run_the_teacher(distilled, tmp_path, monkeypatch):
    monkeypatch.setattr(teacher_mod, "run_teacher", lambda *a, **k: pytest.fail("the teacher ran again"))
    config = distilled["config"].replace(out_dir=tmp_path / "again").with_options(epochs=0.25)
    assert distill(config)["teacher"]["cached"]


def test_the_teacher_pass_alone_fills_the_cache_a_student_then_reads(setup, tmp_path, monkeypatch):
    # what the demo runs once before its students run side by side: the same key as the student's own, no model out
    config = _config(setup, tmp_path, transfer=(str(setup["corpus"]),), distill=DistillOptions(alpha=0.0))
    outputs = teacher_pass(config)
    assert not outputs.cached and len(outputs.outputs) > 100 and not (tmp_path / "out").exists()
    monkeypatch.setattr(teacher_mod, "run_teacher", lambda *a, **k: pytest.fail("the teacher ran again"))
    assert teacher_pass(config).key == outputs.key
    result = distill(config.with_options(epochs=0.25))
    assert result["teacher"]["cached"] and result["teacher"]["outputs"] == outputs.key


def test_several_teachers_outputs_are_averaged_in_the_first_ones_label_order():
    def outputs(key: str, arrays: list) -> teacher_mod.TeacherOutputs:
        return teacher_mod.TeacherOutputs([np.asarray(a, np.float32) for a in arrays], key, {}, cached=True)

    a = outputs("a", [[1.0, 2.0], [3.0, -1.0]])
    b = outputs("b", [[0.0, 4.0], [5.0, 7.0]])  # labels in the other order: (pos, neg) where a has (neg, pos)
    mean = teacher_mod.mean_outputs([a, b], [None, [1, 0]])
    np.testing.assert_array_equal(np.stack(mean.outputs), [[2.5, 1.0], [5.0, 2.0]])
    assert mean.manifest == {"members": ["a", "b"]} and mean.key not in ("a", "b") and mean.cached
    assert teacher_mod.mean_outputs([a], [None]) is a
    # tagging: per word; a word one teacher has no output for (NaN) takes the other's, one neither has stays NaN
    words_a = outputs("a", [[[1.0, 1.0], [np.nan, np.nan], [np.nan, np.nan]]])
    words_b = outputs("b", [[[3.0, 5.0], [2.0, 4.0], [np.nan, np.nan]]])
    tagged = teacher_mod.mean_outputs([words_a, words_b], [None, None])
    np.testing.assert_array_equal(tagged.outputs[0], [[2.0, 3.0], [2.0, 4.0], [np.nan, np.nan]])
    with pytest.raises(BertforgeError, match="other shapes"):
        teacher_mod.mean_outputs([a, outputs("c", [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])], [None, None])


def _labels_swapped(teacher: Path, out: Path) -> Path:
    """The same teacher with its two labels in the other order: its classifier's rows and its label lists swapped."""
    shutil.copytree(teacher, out)
    weights = load_file(out / "model.safetensors")
    for name in ("classifier.weight", "classifier.bias"):
        weights[name] = weights[name].flip(0).contiguous()
    save_file(weights, out / "model.safetensors")
    for name in ("task.json", "config.json"):
        spec = json.loads((out / name).read_text())
        if "labels" in spec:
            spec["labels"] = spec["labels"][::-1]
        if "id2label" in spec:
            spec["id2label"] = {"0": spec["id2label"]["1"], "1": spec["id2label"]["0"]}
            spec["label2id"] = {label: int(i) for i, label in spec["id2label"].items()}
        (out / name).write_text(json.dumps(spec))
    return out


def test_a_student_of_several_teachers_learns_their_mean_each_cached_on_its_own(setup, tmp_path, monkeypatch, capsys):
    swapped = _labels_swapped(setup["teacher"], tmp_path / "swapped")
    examples = [TextExample(id=str(i), text=_review(random.Random(i), i % 2 == 1)) for i in range(8)]
    options, cache = DistillOptions(teacher_engine="fp32"), tmp_path / "cache"
    mine, theirs = (teacher_outputs(t, examples, options, cache=cache, progress=False)
                    for t in (setup["teacher"], swapped))
    np.testing.assert_allclose(np.stack(theirs.outputs)[:, ::-1], np.stack(mine.outputs), atol=1e-5)
    calls = _counting(monkeypatch)
    argv = ["distill", "--teacher", setup["teacher"], swapped, "--student", setup["student"], "--data", setup["data"],
            "--cache-dir", tmp_path / "cache", "--transfer-corpus", setup["corpus"], "--alpha", "0", *ARGS[:-3],
            "--no-progress"]
    assert main([*map(str, argv), "--out", str(tmp_path / "out")]) == 0
    assert "the mean of 2 teachers'" in capsys.readouterr().out and len(calls) == 2
    recorded = json.loads((tmp_path / "out" / "run_config.json").read_text())["teacher"]
    assert recorded["dir"] == str(setup["teacher"])
    assert [m["dir"] for m in recorded["members"]] == [str(setup["teacher"]), str(swapped)]
    keys = [m["outputs"] for m in recorded["members"]]
    assert all((cache / k).is_dir() for k in keys) and recorded["outputs"] not in keys  # the mean is not cached
    assert load_task_model(tmp_path / "out").model.config.labels == ["neg", "pos"]  # the first teacher's order
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]["accuracy"] >= 90.0
    assert main([*map(str, argv), "--out", str(tmp_path / "again"), "--epochs", "0.25"]) == 0
    assert len(calls) == 2 and "from the cache" in capsys.readouterr().out  # neither teacher ran again


@pytest.mark.slow  # two distillations
def test_students_of_other_seeds_learn_from_the_same_sample_of_the_transfer_set(distilled, tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    config = distilled["config"].with_options(epochs=0.25).with_distill(max_transfer_texts=40)  # of 150 snippets
    first, second = (distill(config.replace(out_dir=tmp_path / f"seed{k}").with_options(seed=k)) for k in (1, 2))
    assert len(calls) == 1 and first["teacher"]["outputs"] == second["teacher"]["outputs"] and second["teacher"][
        "cached"] and first["teacher"]["transfer_texts"] == 40


def test_a_bag_of_words_blended_into_the_teacher_is_chosen_on_dev_and_recorded(setup, tmp_path, capsys):
    config = _config(setup, tmp_path, transfer=(str(setup["corpus"]),),
                     distill=DistillOptions(alpha=0.0, blend_bag_of_words=True))
    distill(config.with_options(epochs=0.5))
    blend = json.loads((tmp_path / "out" / "run_config.json").read_text())["teacher"]["bag_of_words"]
    # a teacher right on every dev example, and a bag of words no better: the teacher is kept whole
    assert blend["weight"] == 1.0 and blend["dev"]["teacher"] == blend["dev"]["blend"] == 100.0
    # and said before the student trains
    assert (f"bag of words in the teacher: weight 1.00 on the teacher (C {blend['c']:g}); dev accuracy teacher 100.00, "
            f"bag of words {blend['dev']['bag_of_words']:.2f}, blend 100.00\n") in capsys.readouterr().out
    entries = [json.loads(m.read_text()) for m in (tmp_path / "cache").glob("*/manifest.json")]
    assert sorted(m["examples"] for m in entries) == [32, 96 + 150]  # the teacher on dev too, cached as its own
    with pytest.raises(BertforgeError, match="--blend-bag-of-words: .* is a token classification task"):
        distill_run.bag_of_words.check_task(get_task("conll2003"))


def test_a_preset_student_takes_the_teachers_tokenizer(setup, tmp_path):
    result = distill(_config(setup, tmp_path, student="tiny").with_options(epochs=1.0, max_length=16))
    tm = load_task_model(tmp_path / "out")
    assert tm.tokenizer.vocab == VOCAB and tm.model.config.hidden_size == 128 and result["metrics"]


def test_a_time_budget_cuts_the_students_epochs_to_the_steps_it_buys(setup, tmp_path):
    """`--minutes` is fine-tuning's (tests/test_finetune_budget.py), here on the student's training: on a simulated
    clock of 1 s a step, a budget of the planner's timed steps and 12 more trains 12 steps of the 4 epochs' 48."""
    with simulated_clock(1.0):
        distill(_config(setup, tmp_path).with_options(epochs=4.0, max_length=16,
                                                       minutes=(TIMED_STEPS + 2 + 12) / 60))
    out = tmp_path / "out"
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    assert train[-1]["step"] == 12  # logged every 3 steps (a quarter of an epoch)
    assert json.loads((out / "budget_plan.json").read_text())["steps"] == 12


@pytest.mark.slow  # three distillations
def test_a_killed_run_resumes_to_the_uninterrupted_result(setup, distilled, tmp_path, capsys):
    config = distilled["config"]
    argv = ["distill", "--teacher", setup["teacher"], "--student", setup["student"], "--data", setup["data"],
            "--transfer-corpus", setup["corpus"], "--alpha", "0", "--cache-dir", config.cache_dir, *ARGS,
            "--out", tmp_path / "run"]
    log = tmp_path.parent / f"{tmp_path.name}.log"
    killed = Forked(argv, log, before=lambda: kill_at("bertforge.train.loop:train_step:9")).wait()
    assert killed == -signal.SIGKILL, log.read_text()
    assert not (tmp_path / "run").exists() and (tmp_path / "run.partial").is_dir()
    assert main([str(a) for a in argv] + ["--resume"]) == 0
    printed = capsys.readouterr().out
    assert "(step 6)" in printed and "from the cache" in printed, printed
    for name in ("model.safetensors", "metrics.json", "task.json", "predictions_dev.json"):
        assert (tmp_path / "run" / name).read_bytes() == (distilled["out"] / name).read_bytes(), name


# --- refusals -----------------------------------------------------------------------------------------------------


def _one_error(capsys, argv: list) -> str:
    code = main(["distill", *[str(a) for a in argv]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_bad_input_is_one_error_line_and_nothing_is_written(setup, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["--student", setup["student"], "--out", out, "--cache-dir", tmp_path / "cache", "--no-progress"]
    task = ["--task", "csv", "--data", setup["data"]]
    assert "is not a directory" in _one_error(capsys, ["--teacher", tmp_path / "none", *task, *base])
    assert "has no task.json" in _one_error(capsys, ["--teacher", setup["student"], *task, *base])
    assert "fine-tuned on csv" in _one_error(capsys, ["--teacher", setup["teacher"], "--task", "jsonl", "--data",
                                                      setup["data"], *base])
    other = _write_task(tmp_path / "other-labels", labels=("neg", "neutral"))
    assert "lack neutral" in _one_error(capsys, ["--teacher", setup["teacher"], "--task", "csv", "--data", other,
                                                 *base])
    assert "question answering" in _one_error(capsys, ["--teacher", setup["teacher"], "--task", "squad", "--data",
                                                       setup["data"], *base])
    pairs = ["--text-pair-column", "text", "--transfer-corpus", setup["corpus"]]
    assert "sentence-pair task" in _one_error(capsys, ["--teacher", setup["teacher"], *task, *pairs, *base])
    (tmp_path / "empty.txt").write_text("")
    assert "holds no text" in _one_error(capsys, ["--teacher", setup["teacher"], *task, "--transfer-corpus",
                                                  tmp_path / "empty.txt", *base])
    assert "neither a model directory" in _one_error(capsys, ["--teacher", setup["teacher"], *task, *base[2:],
                                                              "--student", "huge"])
    assert "--temperature" in _one_error(capsys, ["--teacher", setup["teacher"], *task, *base, "--temperature", "0"])
    assert "given twice" in _one_error(capsys, ["--teacher", setup["teacher"], setup["teacher"], *task, *base])
    renamed = shutil.copytree(setup["teacher"], tmp_path / "renamed")
    spec = json.loads((renamed / "task.json").read_text())
    (renamed / "task.json").write_text(json.dumps({**spec, "labels": ["bad", "good"]}))
    assert "give teachers fine-tuned on the same labels" in _one_error(
        capsys, ["--teacher", setup["teacher"], renamed, *task, *base])
    assert not out.exists() and not (tmp_path / "out.partial").exists() and not (tmp_path / "cache").exists()
