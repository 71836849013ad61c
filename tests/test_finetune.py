"""Fine-tuning end to end: every task format in its official layout goes through `bertforge finetune`,
`evaluate` and `predict` on a tiny model; the output directory; the grid and seeds; bad input; learning.

The fixture files are written here, in each format's official layout, from a small seeded generator whose
label is a keyword of the text (so the tasks are learnable, see `test_a_tiny_model_learns_a_keyword_task`).
"""

from __future__ import annotations

import csv
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from bertforge import BertConfig, BertForPreTraining, Tokenizer
from bertforge.cli import build_parser, main
from bertforge.commands.arguments import build_args
from bertforge.commands.finetune import finetune_config
from bertforge.errors import BertforgeError
from bertforge.finetune import run as ft
from bertforge.finetune import sweep
from bertforge.finetune.config import FinetuneConfig
from bertforge.options import FinetuneOptions
from bertforge.tasks.runner import evaluate_examples, load_task_model
from bertforge.train.rundir import RUN_CONFIG

FILLER = ["the", "a", "film", "story", "plot", "actor", "scene", "city", "river", "house", "game", "book", "night",
          "day", "man", "woman", "child", "dog", "walks", "runs", "sees", "finds", "likes", "told", "about", "over",
          "near", "with", "from", "into"]
NAMES = ["paris", "london", "john", "mary", "acme", "globex"]
TYPES = {"paris": "LOC", "london": "LOC", "john": "PER", "mary": "PER", "acme": "ORG", "globex": "ORG"}
GOOD, BAD = "great", "awful"
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=128)
FAST = ["--batch-size", "8", "--epochs", "1", "--lr", "1e-3", "--max-length", "48"]
FAST_OPTIONS = dict(batch_size=8, epochs=1.0, lr=1e-3, max_length=48, progress=False)  # FAST, for the library
CUSTOM = {"text_column": "review", "label_column": "stars"}  # CUSTOM_OPTIONS, for the library


def config(data: Path, init: Path, out: Path, task: str = "csv", task_options: dict | None = None,
           **options) -> FinetuneConfig:
    """A fast fine-tuning of `write_custom`'s data (or `task`'s), FAST_OPTIONS changed by `options`."""
    return FinetuneConfig(task=task, data_dir=data, init=init, out_dir=out,
                          task_options=dict(CUSTOM if task_options is None else task_options),
                          options=FinetuneOptions(**{**FAST_OPTIONS, **options}))


def sentence(rng: random.Random, n: int = 6, *extra: str) -> str:
    words = [rng.choice(FILLER) for _ in range(n)] + list(extra)
    rng.shuffle(words)
    return " ".join(words)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: a tiny model gains nothing from two, and on a busy machine two OpenMP threads
    spin against each other (a tiny step measured 1.4 s with two threads, 5 ms with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def init_dir(tmp_path_factory) -> Path:
    """A tiny pretrained-looking model directory: a fixed WordPiece vocabulary (the fixture words whole, plus
    single characters so any other word splits into pieces) and a randomly initialised 2-layer BERT with both
    pretraining heads (what `--init` takes). Written out rather than trained: the engine's trainer breaks
    ties in hash order, so a trained vocabulary differs from run to run and so would every result here."""
    d = tmp_path_factory.mktemp("init")
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,?!'-")
    words = FILLER + NAMES + [GOOD, BAD, "corp", "yes", "no", "maybe", "why", "what", "who", "where", "is", "was"]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + words
    tok = Tokenizer(list(dict.fromkeys(vocab)), lowercase=True)
    tok.save_pretrained(d)
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(vocab_size=tok.vocab_size, **TINY)).save_pretrained(d)
    return d


# --- fixture files in the official layouts --------------------------------------------------------------


def _tsv(path: Path, rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


def _csv(path: Path, rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)


def _labelled(rng: random.Random, n: int) -> list[tuple[str, int]]:
    out = []
    for i in range(n):
        y = i % 2
        out.append((sentence(rng, 5, GOOD if y else BAD), y))
    return out


GLUE_HEADERS = {
    "sst2": ["sentence", "label"],
    "mrpc": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "qqp": ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
    "stsb": ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
             "score"],
    "mnli": ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
             "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"],
    "qnli": ["index", "question", "sentence", "label"],
    "rte": ["index", "sentence1", "sentence2", "label"],
    "wnli": ["index", "sentence1", "sentence2", "label"],
}
NLI = {"mnli": ("contradiction", "entailment", "neutral"), "qnli": ("entailment", "not_entailment"),
       "rte": ("entailment", "not_entailment"), "wnli": ("0", "1")}


def glue_row(task: str, i: int, rng: random.Random, labelled: bool = True) -> list[str]:
    """One row of `task`'s official TSV; the label is decided by a keyword in the text."""
    y = i % (3 if task == "mnli" else 2)
    key = [BAD, GOOD, "maybe"][y]
    a, b = sentence(rng, 5, key), sentence(rng, 5)
    if task == "sst2":
        return [a, str(y)] if labelled else [str(i), a]
    if task == "mrpc":
        return [str(y), str(1000 + i), str(2000 + i), a, b] if labelled else [str(i), str(1000 + i), "0", a, b]
    if task == "qqp":
        return [str(i), str(2 * i), str(2 * i + 1), a, b, str(y)][: 6 if labelled else 5]
    if task == "stsb":
        return [str(i), "main-captions", "MSRvid", "2012test", str(i), "none", "none", a, b, f"{y * 5.0:.3f}"][
            : 10 if labelled else 9]
    if task == "mnli":
        label = NLI["mnli"][y]
        return [str(i), str(i), f"{i}e", "fiction", "( a )", "( b )", "(ROOT a)", "(ROOT b)", a, b, label, label][
            : 12 if labelled else 10]
    return [str(i), a, b, NLI[task][y]][: 4 if labelled else 3]


def write_glue(task: str, root: Path, n_train: int = 24, n_dev: int = 12) -> Path:
    rng = random.Random(task)
    d = root / task
    if task == "cola":  # header-less train/dev: source, label, original label, sentence
        for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
            _tsv(d / name, [["gj04", str(y), "" if y else "*", s] for s, y in _labelled(rng, n)])
        _tsv(d / "test.tsv", [["index", "sentence"], ["0", sentence(rng)]])
        return d
    header = GLUE_HEADERS[task]
    dev_files = ["dev_matched.tsv", "dev_mismatched.tsv"] if task == "mnli" else ["dev.tsv"]
    _tsv(d / "train.tsv", [header] + [glue_row(task, i, rng) for i in range(n_train)])
    for name in dev_files:
        _tsv(d / name, [header] + [glue_row(task, i, rng) for i in range(n_dev)])
    test_header = [h for h in header if h not in ("label", "gold_label", "label1", "score", "is_duplicate")]
    if task == "mrpc":
        test_header = ["index", "#1 ID", "#2 ID", "#1 String", "#2 String"]
    if task == "sst2":
        test_header = ["index", "sentence"]
    for name in ["test_matched.tsv", "test_mismatched.tsv"] if task == "mnli" else ["test.tsv"]:
        _tsv(d / name, [test_header] + [glue_row(task, i, rng, labelled=False) for i in range(3)])
    return d


SWAG_HEADER = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1",
               "ending2", "ending3", "label"]


def write_swag(root: Path, n_train: int = 16, n_dev: int = 8) -> Path:
    """The official SWAG CSVs: train.csv, val.csv, test.csv (no label); the right ending holds GOOD."""
    rng = random.Random("swag")
    d = root / "swag"

    def rows(n: int, labelled: bool) -> list[list]:
        out = [SWAG_HEADER if labelled else SWAG_HEADER[:-1]]
        for i in range(n):
            y = i % 4
            endings = [sentence(rng, 3, GOOD if j == y else BAD) for j in range(4)]
            s1, s2 = sentence(rng, 5), "the man"
            row = [i, f"lsmdc{i}", i, f"{s1} {s2}", s1, s2, "gold", *endings, y]
            out.append(row if labelled else row[:-1])
        return out

    _csv(d / "train.csv", rows(n_train, True))
    _csv(d / "val.csv", rows(n_dev, True))
    _csv(d / "test.csv", rows(2, False))
    return d


def squad_json(rng: random.Random, n_paragraphs: int, prefix: str) -> dict:
    """SQuAD v1.1: data[].paragraphs[].{context, qas[].{id, question, answers[].{text, answer_start}}}.
    Contexts are long enough to need several windows at max length 48."""
    articles = []
    for a in range(n_paragraphs):
        name = NAMES[a % len(NAMES)]
        words = [rng.choice(FILLER) for _ in range(40)]
        words[rng.randrange(5, 35)] = name
        context = " ".join(words) + " ."
        start = context.index(name)
        qas = [{"id": f"{prefix}{a}-{k}", "question": f"who {q} ?",
                "answers": [{"text": name, "answer_start": start}, {"text": name, "answer_start": start}]}
               for k, q in enumerate(["is it", "was it"])]
        articles.append({"title": f"t{a}", "paragraphs": [{"context": context, "qas": qas}]})
    return {"version": "1.1", "data": articles}


def write_squad(root: Path) -> Path:
    rng = random.Random("squad")
    d = root / "squad"
    d.mkdir(parents=True, exist_ok=True)
    (d / "train-v1.1.json").write_text(json.dumps(squad_json(rng, 8, "tr")))
    (d / "dev-v1.1.json").write_text(json.dumps(squad_json(rng, 4, "dv")))
    return d


def conll_text(rng: random.Random, n: int) -> str:
    """CoNLL-2003: `word POS chunk NER` per line (IOB1, as the original files), blank line between
    sentences, -DOCSTART- between documents."""
    lines = ["-DOCSTART- -X- -X- O", ""]
    for i in range(n):
        words = [(w, "O") for w in sentence(rng, 6).split()]
        name = NAMES[i % len(NAMES)]
        pos = rng.randrange(len(words))
        words[pos:pos] = [(name, f"I-{TYPES[name]}"), ("corp" if TYPES[name] == "ORG" else name, f"I-{TYPES[name]}")]
        lines += [f"{w} NN I-NP {t}" for w, t in words] + [""]
    return "\n".join(lines) + "\n"


def write_conll(root: Path) -> Path:
    rng = random.Random("conll")
    d = root / "conll"
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.txt").write_text(conll_text(rng, 24))
    (d / "valid.txt").write_text(conll_text(rng, 10))
    (d / "test.txt").write_text(conll_text(rng, 4))
    return d


def write_custom(kind: str, root: Path, *, regression: bool = False, pair: bool = False) -> Path:
    """Your own data: train/dev files with a header (CSV) or one JSON object per line (JSONL), with extra
    columns that must do no harm; the text column is `review`, the label `stars`."""
    rng = random.Random(kind)
    d = root / f"{kind}{'-reg' if regression else ''}"
    d.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 24), ("dev", 12)):
        records = []
        for i in range(n):
            y = i % 2
            label: str | float = (4.5 if y else 1.0) if regression else ("pos" if y else "neg")
            records.append({"id": f"{split}{i}", "review": sentence(rng, 5, GOOD if y else BAD),
                            "other": sentence(rng, 3), "stars": label, "extra": i})
        if kind == "csv":
            _csv(d / f"{split}.csv", [list(records[0])] + [list(r.values()) for r in records])
        else:
            (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


# --- one case per format ----------------------------------------------------------------------------------


@dataclass
class Case:
    task: str
    write: Callable[[Path], Path]
    metrics: tuple[str, ...]  # keys metrics.json must hold; the first is the main metric
    predict: list[str]  # predict arguments after --model
    check: Callable[[dict], None]  # one prediction's shape
    options: list[str] = field(default_factory=list)
    extra_splits: tuple[str, ...] = ()


def is_label(names: tuple[str, ...]) -> Callable[[dict], None]:
    def check(p: dict) -> None:
        assert p["label"] in names
        assert set(p["probabilities"]) == set(names)
        assert sum(p["probabilities"].values()) == pytest.approx(1, abs=1e-5)
    return check


def is_score(p: dict) -> None:
    assert isinstance(p["score"], float) and set(p) == {"score"}


def is_choice(p: dict) -> None:
    assert p["choice"] in range(4) and len(p["probabilities"]) == 4
    assert sum(p["probabilities"]) == pytest.approx(1, abs=1e-5)


NER_TEXT = "john walks near paris with mary"
QA_CONTEXT = "the man from london told a story about the river near the house ."


def is_entities(p: dict) -> None:
    assert [w for w, _ in p["tags"]] == NER_TEXT.split()
    for e in p["entities"]:
        assert e["type"] in ("PER", "LOC", "ORG", "MISC")
        assert NER_TEXT[e["start"]:e["end"]] == e["text"] and e["text"]


def is_answer(p: dict) -> None:
    assert p["answer"] and p["answer"] in QA_CONTEXT
    assert QA_CONTEXT[p["start"]:p["end"]] == p["answer"] and 0 <= p["score"] <= 1


BINARY = ("0", "1")
CASES = {
    **{t: Case(t, lambda root, t=t: write_glue(t, root), m, ["--text", "a great film", "an awful story"],
               is_label(labels))
       for t, m, labels in [("cola", ("mcc", "accuracy"), BINARY), ("sst2", ("accuracy",), BINARY),
                            ("wnli", ("accuracy",), BINARY), ("qnli", ("accuracy",), NLI["qnli"]),
                            ("rte", ("accuracy",), NLI["rte"])]},
    **{t: Case(t, lambda root, t=t: write_glue(t, root), m,
               ["--text", "a great film", "the plot", "--text-pair", "an awful story"], is_label(BINARY))
       for t, m in [("mrpc", ("f1", "accuracy")), ("qqp", ("f1", "accuracy"))]},
    "mnli": Case("mnli", lambda root: write_glue("mnli", root), ("accuracy",),
                 ["--text", "a great film", "--text-pair", "maybe"], is_label(NLI["mnli"]),
                 extra_splits=("dev_mismatched",)),
    "stsb": Case("stsb", lambda root: write_glue("stsb", root), ("spearman", "pearson"),
                 ["--text", "a great film", "--text-pair", "an awful film"], is_score),
    "swag": Case("swag", write_swag, ("accuracy",), ["--input", "{choices}"], is_choice),
    "squad": Case("squad", write_squad, ("f1", "exact_match"),
                  ["--text", "who told a story ?", "--text-pair", QA_CONTEXT], is_answer,
                  options=["--max-length", "48"]),
    "conll2003": Case("conll2003", write_conll, ("f1", "precision", "recall", "accuracy"),
                      ["--text", NER_TEXT], is_entities),
    "csv": Case("csv", lambda root: write_custom("csv", root), ("accuracy", "macro_f1"),
                ["--text", "a great film"], is_label(("neg", "pos")),
                options=["--text-column", "review", "--label-column", "stars"]),
    "csv-regression": Case("csv", lambda root: write_custom("csv", root, regression=True),
                           ("pearson", "spearman"), ["--text", "a great film"], is_score,
                           options=["--text-column", "review", "--label-column", "stars", "--regression"]),
    "jsonl-pair": Case("jsonl", lambda root: write_custom("jsonl", root), ("accuracy", "macro_f1"),
                       ["--input", "{pairs}"], is_label(("neg", "pos")),
                       options=["--text-column", "review", "--text-pair-column", "other", "--label-column",
                                "stars"]),
}


def _predict_inputs(tmp: Path) -> dict[str, str]:
    choices = tmp / "choices.jsonl"
    choices.write_text(json.dumps({"context": "the man walks", "choices": [f"he {w}" for w in
                                                                           (GOOD, BAD, "runs", "sees")]}) + "\n")
    pairs = tmp / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"text": t, "text_pair": "the plot"}) + "\n" for t in ("great", "awful")))
    return {"choices": str(choices), "pairs": str(pairs)}


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", list(CASES))
def test_every_format_finetunes_evaluates_and_predicts(name, init_dir, tmp_path, capsys):
    case = CASES[name]
    data, out = case.write(tmp_path / "data"), tmp_path / "run"
    code, stdout, err = _cli(capsys, "finetune", "--task", case.task, "--data", data, "--init", init_dir,
                             "--out", out, *FAST, *case.options)
    assert code == 0, err
    assert "best dev" in stdout and f"model saved to {out}" in stdout

    # the output directory: the best model with its label map and tokenizer, metrics, predictions, progress
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json", "task.json", "metrics.json",
            "metrics.jsonl", "run_config.json", "predictions_dev.json"} <= names, names
    assert not names & {"checkpoints", "best", "last"} and not [n for n in names if n.startswith(".")]
    spec = json.loads((out / "task.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert spec["task"] == case.task and config["bertforge_task"] == case.task
    if spec["kind"] in ("classification", "token_classification"):
        assert config["id2label"] == {str(i): lab for i, lab in enumerate(spec["labels"])}
        assert config["label2id"] == {lab: i for i, lab in enumerate(spec["labels"])}
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(case.metrics) <= set(metrics["metrics"]) and metrics["main_metric"] == case.metrics[0]
    assert metrics["best_step"] >= 1 and metrics["history"]
    progress = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in progress} == {"train", "eval"}
    dev_predictions = json.loads((out / "predictions_dev.json").read_text())

    # the model loads back and `evaluate` reproduces the best dev score
    for split in ("dev", *case.extra_splits):
        report = tmp_path / f"eval-{split}.json"
        code, stdout, err = _cli(capsys, "evaluate", "--model", out, "--data", data, "--split", split,
                                 "--out", report)
        assert code == 0, err
        evaluated = json.loads(report.read_text())
        assert set(case.metrics) <= set(evaluated["metrics"])
        if split == "dev":
            assert evaluated["metrics"] == pytest.approx(metrics["metrics"], abs=1e-6)
            assert evaluated["predictions"] == pytest.approx(dev_predictions) if name == "stsb" or name.endswith(
                "regression") else evaluated["predictions"] == dev_predictions
    if case.task == "squad":  # the official predictions format: {question id: answer text}, texts from the context
        dev = json.loads((data / "dev-v1.1.json").read_text())
        contexts = {qa["id"]: p["context"] for a in dev["data"] for p in a["paragraphs"] for qa in p["qas"]}
        assert set(dev_predictions) == set(contexts)
        assert all(text in contexts[qid] for qid, text in dev_predictions.items())

    # predict: the right shape of answer per input
    args = [a.format(**_predict_inputs(tmp_path)) for a in case.predict]
    code, stdout, err = _cli(capsys, "predict", "--model", out, *args)
    assert code == 0, err
    predictions = [json.loads(line) for line in stdout.splitlines()]
    if "--input" in args:
        n_inputs = len(Path(args[args.index("--input") + 1]).read_text().splitlines())
    else:
        texts = args[args.index("--text") + 1:]
        n_inputs = next((i for i, a in enumerate(texts) if a.startswith("--")), len(texts))
    assert len(predictions) == n_inputs
    for p in predictions:
        case.check(p)


def test_evaluate_an_unlabelled_split_gives_predictions_with_ids(init_dir, tmp_path, capsys):
    data, out = write_glue("mnli", tmp_path / "data"), tmp_path / "run"
    assert _cli(capsys, "finetune", "--task", "mnli", "--data", data, "--init", init_dir, "--out", out, *FAST)[0] == 0
    report = tmp_path / "test.json"
    code, stdout, err = _cli(capsys, "evaluate", "--model", out, "--data", data, "--split", "test_mismatched",
                             "--out", report)
    assert code == 0, err
    assert "no gold labels, predictions only" in stdout
    result = json.loads(report.read_text())
    assert result["metrics"] == {} and result["ids"] == ["0", "1", "2"]
    assert set(result["predictions"]) <= set(NLI["mnli"]) and len(result["predictions"]) == 3


# --- bad input: one line naming the file and line, exit 2, nothing written -----------------------------------


def _edit(path: Path, line: int, new: str | None) -> None:
    """Replace (or with None, delete) 1-based line `line` of a text file; line 0 appends `new`."""
    lines = path.read_text().splitlines()
    if line == 0:
        lines.append(new or "")
    elif new is None:
        del lines[line - 1]
    else:
        lines[line - 1] = new
    path.write_text("\n".join(lines) + "\n")


def _set_field(path: Path, line: int, column: int, value: str, sep: str = "\t") -> None:
    fields = path.read_text().splitlines()[line - 1].split(sep)
    fields[column] = value
    _edit(path, line, sep.join(fields))


def _squad_answer(d: Path, text: str) -> None:
    data = json.loads((d / "train-v1.1.json").read_text())
    data["data"][1]["paragraphs"][0]["qas"][1]["answers"][0]["text"] = text
    (d / "train-v1.1.json").write_text(json.dumps(data, indent=1))


def _csv_labels(d: Path, label: str) -> None:
    rows = list(csv.reader((d / "train.csv").open()))
    rows[1:] = [r[:3] + [label] + r[4:] for r in rows[1:]]
    _csv(d / "train.csv", rows)


CUSTOM_OPTIONS = ["--text-column", "review", "--label-column", "stars"]
BAD_INPUTS = {
    # name: (task, writer, edit of the written data, extra options, the message (a regex))
    "glue missing column": ("sst2", lambda r: write_glue("sst2", r),
                            lambda d: _edit(d / "train.tsv", 1, "text\tlabel"), [],
                            r"sst2/train.tsv:1: no column 'sentence' in the header \('text', 'label'\)"),
    "glue short row": ("rte", lambda r: write_glue("rte", r), lambda d: _edit(d / "train.tsv", 0, "99\tonly one"),
                       [], r"rte/train.tsv:26: expected at least 4 tab-separated columns, found 2"),
    "glue unknown label": ("mnli", lambda r: write_glue("mnli", r),
                           lambda d: _set_field(d / "dev_matched.tsv", 3, -1, "maybe"), [],
                           r"mnli/dev_matched.tsv:3: unknown label 'maybe' \(the task's labels: contradiction, "
                           r"entailment, neutral\)"),
    "stsb score not a number": ("stsb", lambda r: write_glue("stsb", r),
                                lambda d: _set_field(d / "train.tsv", 4, -1, "high"), [],
                                r"stsb/train.tsv:4: score 'high' is not a number"),
    "glue empty train": ("sst2", lambda r: write_glue("sst2", r), lambda d: (d / "train.tsv").write_text(""), [],
                         r"sst2/train.tsv is empty"),
    "glue header only": ("qnli", lambda r: write_glue("qnli", r),
                         lambda d: (d / "dev.tsv").write_text("index\tquestion\tsentence\tlabel\n"), [],
                         r"qnli/dev.tsv has a header but no examples"),
    "glue no dev file": ("wnli", lambda r: write_glue("wnli", r), lambda d: (d / "dev.tsv").unlink(), [],
                         r"no dev file for task wnli in .*wnli: expected dev.tsv"),
    "csv missing column": ("csv", lambda r: write_custom("csv", r), lambda d: None, [],
                           r"csv/train.csv:1: no column 'text' \(columns: id, review, other, stars, extra\); name "
                           r"the right one with text_column"),
    "csv ragged row": ("csv", lambda r: write_custom("csv", r), lambda d: _edit(d / "dev.csv", 4, "a,b,c"),
                       CUSTOM_OPTIONS, r"csv/dev.csv:4: 3 columns where the header has 5"),
    "csv unknown dev label": ("csv", lambda r: write_custom("csv", r),
                              lambda d: _set_field(d / "dev.csv", 5, 3, "meh", ","), CUSTOM_OPTIONS,
                              r"csv/dev.csv:5: unknown label 'meh' \(the task's labels: neg, pos\)"),
    "csv dev without labels": ("csv", lambda r: write_custom("csv", r),
                               lambda d: _csv(d / "dev.csv", [["review"], ["a great film"]]), CUSTOM_OPTIONS,
                               r"csv/dev.csv:2: no gold label to score against"),
    "csv one label": ("csv", lambda r: write_custom("csv", r), lambda d: _csv_labels(d, "pos"), CUSTOM_OPTIONS,
                      r"csv/train.csv: every training example has the label 'pos'; classification needs at "
                      r"least two labels"),
    "csv empty": ("csv", lambda r: write_custom("csv", r), lambda d: (d / "train.csv").write_text(""),
                  CUSTOM_OPTIONS, r"csv/train.csv is empty"),
    "regression label not a number": ("csv", lambda r: write_custom("csv", r, regression=True),
                                      lambda d: _set_field(d / "train.csv", 3, 3, "lots", ","),
                                      [*CUSTOM_OPTIONS, "--regression"],
                                      r"csv-reg/train.csv:3: 'stars' is 'lots', not a number"),
    "jsonl bad json": ("jsonl", lambda r: write_custom("jsonl", r), lambda d: _edit(d / "train.jsonl", 3, "{oops"),
                       CUSTOM_OPTIONS, r"jsonl/train.jsonl:3: not valid JSON"),
    "jsonl missing field": ("jsonl", lambda r: write_custom("jsonl", r),
                            lambda d: _edit(d / "dev.jsonl", 2, json.dumps({"stars": "pos"})), CUSTOM_OPTIONS,
                            r"jsonl/dev.jsonl:2: no field 'review' \(fields: stars\)"),
    "jsonl empty": ("jsonl", lambda r: write_custom("jsonl", r), lambda d: (d / "train.jsonl").write_text("\n"),
                    CUSTOM_OPTIONS, r"jsonl/train.jsonl has no examples"),
    "conll one column": ("conll2003", write_conll, lambda d: _edit(d / "train.txt", 5, "lonely"), [],
                         r"conll/train.txt:5: expected 'word ... tag' columns, found 'lonely'"),
    "conll unknown dev tag": ("conll2003", write_conll, lambda d: _set_field(d / "valid.txt", 4, -1, "B-FOO", " "),
                              [], r"conll/valid.txt:3: unknown label 'B-FOO'"),
    "conll empty": ("conll2003", write_conll, lambda d: (d / "train.txt").write_text("-DOCSTART- -X- -X- O\n\n"),
                    [], r"conll/train.txt has no sentences"),
    "swag bad label": ("swag", write_swag, lambda d: _set_field(d / "train.csv", 3, -1, "7", ","), [],
                       r"swag/train.csv:3: label '7' is not a choice number 0-3"),
    "swag missing column": ("swag", write_swag,
                            lambda d: _edit(d / "val.csv", 1, ",".join(SWAG_HEADER).replace("ending3", "end3")), [],
                            r"swag/val.csv:1: no column 'ending3'"),
    "swag empty": ("swag", write_swag, lambda d: (d / "train.csv").write_text(""), [], r"swag/train.csv is empty"),
    "squad answer not in context": ("squad", write_squad, lambda d: _squad_answer(d, "zebra"), [],
                                    r"squad/train-v1.1.json:\d+: question tr1-1: answer 'zebra' does not occur in "
                                    r"its context"),
    "squad empty": ("squad", write_squad, lambda d: (d / "dev-v1.1.json").write_text(""), [],
                    r"squad/dev-v1.1.json is empty"),
    "squad not json": ("squad", write_squad, lambda d: (d / "train-v1.1.json").write_text('{"data": [\n{oops'),
                       [], r"squad/train-v1.1.json:2: not valid JSON"),
}


def _one_line_error(capsys, *args, during_training: bool = False) -> str:
    """The error line of a command that must fail with exit code 2. Bad input is found before any work, so
    the error is all of stderr; a failure during training comes after the progress output."""
    code, stdout, err = _cli(capsys, *args)
    assert code == 2, (stdout, err)
    assert "Traceback" not in err and err.endswith("\n"), err
    lines = err.splitlines()
    assert [line for line in lines if line.startswith("error: ")] == [lines[-1]], err
    if not during_training:
        assert len(lines) == 1, err
    return lines[-1]


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_fails_in_one_line_naming_file_and_line(name, init_dir, tmp_path, capsys):
    import re

    task, write, edit, options, message = BAD_INPUTS[name]
    data = write(tmp_path / "data")
    edit(data)
    out = tmp_path / "run"
    err = _one_line_error(capsys, "finetune", "--task", task, "--data", data, "--init", init_dir, "--out", out,
                          *FAST, *options)
    assert re.search(message, err), err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["data"]


@pytest.fixture(scope="module")
def csv_model(init_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("csv-model") / "run"
    data = write_custom("csv", out.parent / "data")
    ft.finetune(config(data, init_dir, out))
    return out


def test_bad_input_at_evaluation_and_prediction(csv_model, init_dir, tmp_path, capsys):
    import re

    data = write_custom("csv", tmp_path)
    _set_field(data / "dev.csv", 6, 3, "meh", ",")
    err = _one_line_error(capsys, "evaluate", "--model", csv_model, "--data", data, "--out", tmp_path / "r.json")
    assert re.search(r"csv/dev.csv:6: unknown label 'meh' \(the task's labels: neg, pos\)", err), err
    assert not (tmp_path / "r.json").exists()
    (data / "dev.csv").write_text("")
    assert re.search(r"csv/dev.csv is empty", _one_line_error(capsys, "evaluate", "--model", csv_model, "--data",
                                                                 data))
    err = _one_line_error(capsys, "evaluate", "--model", init_dir, "--data", data)
    assert "has no task.json: it is not a fine-tuned model" in err
    bad = tmp_path / "in.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"review": "no text key"}) + "\n")
    assert "input 2: csv needs 'text'" in _one_line_error(capsys, "predict", "--model", csv_model, "--input", bad)
    bad.write_text("{oops\n")
    assert re.search(r"in.jsonl:1 is not valid JSON", _one_line_error(capsys, "predict", "--model", csv_model,
                                                                     "--input", bad))


# --- nothing half-written -----------------------------------------------------------------------------------


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_failed_run_leaves_the_output_as_it_was(csv_model, init_dir, tmp_path, monkeypatch):
    data = write_custom("csv", tmp_path / "data")
    real = ft.TaskObjective.losses
    calls = []

    def diverging(self, model, batch):
        calls.append(1)
        losses = real(self, model, batch)
        return {k: v * float("nan") for k, v in losses.items()} if len(calls) == 3 else losses

    monkeypatch.setattr(ft.TaskObjective, "losses", diverging)
    with pytest.raises(BertforgeError) as failed:
        ft.finetune(config(data, init_dir, tmp_path / "new", batch_size=4))
    assert f"the loss became nan at step 3; {tmp_path / 'new'} was left as it was: lower --lr" in str(failed.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no model, no temporary directory

    # a finished run in --out stays whole (model, logs, metrics) when the run replacing it fails
    before = _snapshot(csv_model)
    calls.clear()
    with pytest.raises(BertforgeError, match="the loss became nan"):
        ft.finetune(config(data, init_dir, csv_model, batch_size=4))
    assert _snapshot(csv_model) == before
    assert sorted(p.name for p in csv_model.parent.iterdir() if p.name.startswith(".")) == []


def test_an_interrupted_run_leaves_out_as_it_was_exits_130_and_resumes(init_dir, tmp_path, capsys, monkeypatch):
    import os
    import signal

    data = write_custom("csv", tmp_path / "data")
    real = ft.TaskObjective.losses

    def interrupted(self, model, batch):
        os.kill(os.getpid(), signal.SIGINT)  # the loop checkpoints and stops after this step
        return real(self, model, batch)

    monkeypatch.setattr(ft.TaskObjective, "losses", interrupted)
    code, _, err = _cli(capsys, "finetune", "--task", "csv", "--data", data, "--init", init_dir, "--out",
                        tmp_path / "run", *FAST, *CUSTOM_OPTIONS)
    assert code == 130 and "interrupted" in err and "was left as it was" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "run.partial"]  # no model: its checkpoint
    resume = err.splitlines()[-1]
    assert resume.startswith("to resume: bertforge finetune --task csv ") and resume.endswith(" --resume"), resume
    monkeypatch.setattr(ft.TaskObjective, "losses", real)
    code, _, err = _cli(capsys, *resume.split()[3:])
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "run"]


def test_checkpoints_every_save_minutes_of_training_keeping_the_last_keep_last(init_dir, tmp_path, monkeypatch):
    import itertools
    import time
    from types import SimpleNamespace

    from bertforge.train import checkpoints as state
    from bertforge.train import loop

    # a clock that moves 3 minutes each time the loop reads it: once after each step, once after each checkpoint
    minutes = itertools.count(0, 3)
    monkeypatch.setattr(loop, "time", SimpleNamespace(monotonic=lambda: 60.0 * next(minutes),
                                                      perf_counter=time.perf_counter))
    saved: list[tuple[int, list[int]]] = []  # (step, the checkpoints on disk after it)
    real = loop.save_checkpoint

    def recording(out_dir, step, *args, **kwargs):
        real(out_dir, step, *args, **kwargs)
        saved.append((step, [s for s, _ in state.checkpoints(out_dir)]))

    monkeypatch.setattr(loop, "save_checkpoint", recording)
    data = write_custom("csv", tmp_path / "data")
    run = config(data, init_dir, tmp_path / "run", epochs=4)
    ft.finetune(run.with_options(keep_last=2))
    steps = json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"]
    assert steps >= 9
    # read at steps 1, 2, 3 (3, 6, 9 minutes): not yet; step 4 (12) saves and restarts the count at 15; step 8...
    expected = [s for s in range(4, steps, 4)] + [steps]
    assert [s for s, _ in saved] == expected
    assert [kept for _, kept in saved] == [expected[max(0, i - 1):i + 1] for i in range(len(expected))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "run"]

    # --save-minutes 0: only --save-every's steps and the end
    saved.clear()
    ft.finetune(run.with_options(save_minutes=0, save_every=3))
    assert [s for s, _ in saved] == [s for s in range(3, steps, 3)] + [steps]
    assert [kept for _, kept in saved][-1] == [steps]  # --keep-last 1 by default


def test_out_that_is_not_a_run_directory_is_refused(init_dir, tmp_path):
    data = write_custom("csv", tmp_path / "data")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    for out in (tmp_path / "mine", init_dir, data / "train.csv"):
        with pytest.raises(BertforgeError, match=f"--out {re.escape(str(out))} is"):
            ft.finetune(config(data, init_dir, out))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


# --- the paper's grid and several seeds ----------------------------------------------------------------------


def test_paper_grid_is_the_papers():
    assert sweep.PAPER_GRID == {"batch_size": (16, 32), "lr": (5e-5, 3e-5, 2e-5), "epochs": (2, 3, 4)}


@pytest.mark.slow  # a grid of fine-tunings
def test_grid_and_seeds_report_mean_std_and_keep_the_best(init_dir, tmp_path, capsys, monkeypatch):
    import statistics

    from safetensors.torch import load_file

    monkeypatch.setattr(sweep, "PAPER_GRID", {"batch_size": (8,), "lr": (1e-3, 1e-5), "epochs": (1,)})
    data, out = write_glue("sst2", tmp_path / "data"), tmp_path / "grid"
    swept = FinetuneConfig(task="sst2", data_dir=data, init=init_dir, out_dir=out,
                           options=FinetuneOptions(max_length=32, progress=False))
    report = sweep.finetune_many(swept, grid=True, seeds=2)
    assert report == json.loads((out / "metrics.json").read_text())
    assert [r["settings"] for r in report["all"]] == [{"batch_size": 8, "lr": 1e-3, "epochs": 1},
                                                      {"batch_size": 8, "lr": 1e-5, "epochs": 1}]
    for r in report["all"]:
        scores = [run["metrics"]["accuracy"] for run in r["runs"]]
        assert [run["seed"] for run in r["runs"]] == [42, 43]
        assert r["mean"]["accuracy"] == pytest.approx(statistics.fmean(scores))
        assert r["std"]["accuracy"] == pytest.approx(statistics.stdev(scores))
    best = max(report["all"], key=lambda r: r["mean"]["accuracy"])
    assert report["best_settings"] == best["settings"]
    assert report["metrics"] == best["best_run"]["metrics"]

    # four runs, each complete; only the chosen one keeps its weights, and it is the model in --out
    run_dirs = sorted((out / "runs").iterdir())
    assert len(run_dirs) == 4 and all((d / "metrics.json").is_file() for d in run_dirs)
    kept = [d for d in run_dirs if (d / "model.safetensors").is_file()]
    assert [str(d) for d in kept] == [best["best_run"]["dir"]]
    top, chosen = load_file(out / "model.safetensors"), load_file(kept[0] / "model.safetensors")
    assert all(torch.equal(top[k], chosen[k]) for k in chosen)
    assert json.loads((out / RUN_CONFIG).read_text())["seeds"] == 2
    code, stdout, err = _cli(capsys, "evaluate", "--model", out, "--data", data)
    assert code == 0 and f"accuracy {report['metrics']['accuracy']:.2f}" in stdout

    # the same directory can take a new run (an earlier fine-tuning run is replaced, not refused)
    assert sweep.finetune_many(swept.with_options(batch_size=8), seeds=2)["best_settings"] == {}


@pytest.mark.slow  # four fine-tunings, two of them in worker processes
def test_seeds_two_at_a_time_end_as_one_after_another_on_as_many_threads(init_dir, tmp_path, capsys):
    data = write_glue("sst2", tmp_path / "data")
    swept = FinetuneConfig(task="sst2", data_dir=data, init=init_dir, out_dir=tmp_path / "one",
                           options=FinetuneOptions(max_length=32, batch_size=8, progress=False))
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' share of two threads: one each
    try:
        alone = sweep.finetune_many(swept, seeds=2)
    finally:
        torch.set_num_threads(before)
    with_jobs = sweep.finetune_many(swept.replace(out_dir=tmp_path / "two"), seeds=2, jobs=2)
    assert [r["metrics"] for r in with_jobs["all"][0]["runs"]] == [r["metrics"] for r in alone["all"][0]["runs"]]
    assert "2 fine-tunings, 2 at a time on " in capsys.readouterr().out
    for seed in (42, 43):  # each run's output in its log beside its directory, which holds what a run holds
        assert "accuracy" in (tmp_path / "two" / "runs" / f"run-seed{seed}.log").read_text()
        assert (tmp_path / "two" / "runs" / f"run-seed{seed}" / "metrics.json").is_file()
    assert not list((tmp_path / "one" / "runs").glob("*.log"))


def test_jobs_under_torchrun_is_refused_in_one_line_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    swept = FinetuneConfig(task="sst2", data_dir=tmp_path / "data", init=tmp_path / "init", out_dir=tmp_path / "out")
    with pytest.raises(BertforgeError, match="under torchrun every run already spans its processes: leave out --jobs"):
        sweep.finetune_many(swept, seeds=2, jobs=2)
    assert not (tmp_path / "out").exists()


# --- the command line: flags mapped to one FinetuneConfig --------------------------------------------------------


def _parsed(*argv) -> object:
    ns = build_parser().parse_args([str(a) for a in argv])
    return build_args(ns._command.args, ns)


def test_the_command_line_maps_its_flags_to_one_config(tmp_path):
    args = _parsed("finetune", "--task", "csv", "--data", tmp_path / "d", "--init", tmp_path / "i", "--out",
                   tmp_path / "o", *CUSTOM_OPTIONS, "--lr", "1e-3", "--seed", "7", "--reinit-layers", "1", "--resume")
    assert finetune_config(args) == FinetuneConfig(
        task="csv", data_dir=str(tmp_path / "d"), init=str(tmp_path / "i"), out_dir=str(tmp_path / "o"),
        task_options=CUSTOM, options=FinetuneOptions(lr=1e-3, seed=7, reinit_layers=1), resume=True)
    plain = finetune_config(_parsed("finetune", "--task", "sst2", "--data", "d", "--init", "i", "--out", "o"))
    assert plain == FinetuneConfig("sst2", "d", "i", "o") and plain.task_options == {} and not plain.resume


def test_the_command_runs_the_config_and_a_sweep_with_its_grid_and_seeds(tmp_path, capsys, monkeypatch):
    called = []
    metrics = {"accuracy": 75.0}
    monkeypatch.setattr(ft, "finetune", lambda c: called.append(c) or {"best_step": 3, "metrics": metrics})
    monkeypatch.setattr(sweep, "finetune_many", lambda c, **kw: called.append((c, kw)) or {
        "all": [{"settings": {}, "mean": metrics, "std": {"accuracy": 0.5}, "runs": [1, 2]}], "best_settings": {},
        "metrics": metrics})
    base = ["finetune", "--task", "sst2", "--data", "d", "--init", "i", "--out", "o", "--lr", "1e-3"]
    assert main(base) == 0 and called == [finetune_config(_parsed(*base))]
    assert "best dev (step 3): accuracy 75.00" in capsys.readouterr().out
    assert main([*base, "--seeds", "2", "--grid"]) == 0
    assert called[1] == (finetune_config(_parsed(*base)), {"grid": True, "seeds": 2, "jobs": 1})
    assert "accuracy 75.00 ± 0.50 (over 2 seeds)" in capsys.readouterr().out
    assert main([*base, "--seeds", "3", "--jobs", "2"]) == 0
    assert called[2] == (finetune_config(_parsed(*base)), {"grid": False, "seeds": 3, "jobs": 2})


@pytest.mark.parametrize("change, message", [
    ({"task": ""}, "FinetuneConfig.task is empty"),
    ({"out_dir": 3}, "FinetuneConfig.out_dir is 3: give a string or a Path"),
    ({"options": {"lr": 1e-3}}, "FinetuneConfig.options is a dict: give a FinetuneOptions"),
    ({"task_options": ["review"]}, "give a dict of option names"),
    ({"options": FinetuneOptions(from_scratch=True, reinit_layers=1)}, "--reinit-layers 1 re-initialises"),
])
def test_a_config_is_checked_when_made(change, message):
    good = dict(task="csv", data_dir="d", init="i", out_dir="o")
    with pytest.raises(BertforgeError, match=re.escape(message)):
        FinetuneConfig(**{**good, **change})
    assert FinetuneConfig(**{**good, "data_dir": Path("d")}).data_dir == "d"  # a Path kept as its string


def test_a_config_refused_on_the_command_line_is_one_error_line(init_dir, tmp_path, capsys):
    data = write_custom("csv", tmp_path / "data")
    err = _one_line_error(capsys, "finetune", "--task", "csv", "--data", data, "--init", init_dir, "--out",
                          tmp_path / "run", *FAST, *CUSTOM_OPTIONS, "--from-scratch", "--reinit-layers", "1")
    assert "--reinit-layers 1 re-initialises pretrained layers" in err and "drop one of them" in err
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


# --- learning ----------------------------------------------------------------------------------------------


def test_a_tiny_model_learns_a_keyword_task(init_dir, tmp_path):
    """Label = which keyword the text holds: dev accuracy far above chance proves loop + head + labels."""
    rng = random.Random(7)
    d = tmp_path / "data"
    d.mkdir()
    for split, n in (("train", 192), ("dev", 64)):
        rows = [["text", "label"]] + [[sentence(rng, 6, GOOD if i % 2 else BAD), "pos" if i % 2 else "neg"]
                                      for i in range(n)]
        _csv(d / f"{split}.csv", rows)
    options = ft.FinetuneOptions(lr=1e-3, batch_size=16, epochs=8, max_length=32, progress=False, seed=1)
    result = ft.finetune(FinetuneConfig("csv", d, init_dir, tmp_path / "run", options=options))
    assert result["metrics"]["accuracy"] >= 90, result["history"]  # chance: 50
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if r["split"] == "train"]
    assert losses[-1] < 0.6 * losses[0]  # 0.42-0.54 of the start over seeds 1-5 (dropout keeps it from 0)
    tm = load_task_model(tmp_path / "run")
    from bertforge.infer import predict_records

    labels = [p["label"] for p in predict_records(tmp_path / "run", [{"text": f"the film was {GOOD}"},
                                                                     {"text": f"the film was {BAD}"}])]
    assert labels == ["pos", "neg"] and tm.task.labels == ["neg", "pos"]


def test_a_keyword_past_the_first_window_is_read_in_windows(init_dir, tmp_path):
    """Trained on texts within the sequence length (32), scored on 60-word texts whose keyword is in the second
    half: read in windows (the default) dev finds it, read to the first 32 tokens (`windows=1`) it is chance."""
    rng = random.Random(3)
    d = tmp_path / "data"
    d.mkdir()

    def long_text(keyword: str) -> str:
        return " ".join([sentence(rng, 30), sentence(rng, 29, keyword)])

    train = [[sentence(rng, rng.randint(20, 28), GOOD if i % 2 else BAD), "pos" if i % 2 else "neg"]
             for i in range(192)]
    _csv(d / "train.csv", [["text", "label"], *train])
    _csv(d / "dev.csv", [["text", "label"]] + [[long_text(GOOD if i % 2 else BAD), "pos" if i % 2 else "neg"]
                                              for i in range(64)])
    options = ft.FinetuneOptions(lr=1e-3, batch_size=16, epochs=16, max_length=32, progress=False, seed=1)
    result = ft.finetune(FinetuneConfig("csv", d, init_dir, tmp_path / "run", options=options))
    tm = load_task_model(tmp_path / "run")
    dev = tm.task.read(str(d), "dev")
    first_only = evaluate_examples(tm, dev, windows=1)[0]["accuracy"]
    assert result["metrics"]["accuracy"] >= 90 and first_only <= 70, (result["history"], first_only)
    assert evaluate_examples(tm, dev)[0] == result["metrics"]  # evaluate's default reads as fine-tuning's dev did


def test_a_tiny_model_learns_entities_with_character_spans(init_dir, tmp_path):
    rng = random.Random(3)
    d = tmp_path / "conll"
    d.mkdir()
    (d / "train.txt").write_text(conll_text(rng, 120))
    (d / "valid.txt").write_text(conll_text(rng, 30))
    options = ft.FinetuneOptions(lr=2e-3, batch_size=16, epochs=8, max_length=32, progress=False)
    result = ft.finetune(FinetuneConfig("conll2003", d, init_dir, tmp_path / "run", options=options))
    assert result["metrics"]["f1"] >= 80, result["history"]
    from bertforge.infer import predict_records

    text = "john john walks near paris paris ."  # two-word names, as in the training data
    [p] = predict_records(tmp_path / "run", [{"text": text}])
    assert {(e["type"], e["text"], e["start"], e["end"]) for e in p["entities"]} >= {
        ("PER", "john john", 0, 9), ("LOC", "paris paris", 21, 32)}
