"""What the tests of `bertforge serve` share: tiny random model directories of each kind, a server on a free
loopback port in this process, a hold on its engine, and bounded waits."""

import contextlib
import json
import threading
import time
from pathlib import Path

import httpx
import torch

from bertforge import BertConfig, BertForMaskedLM
from bertforge.models import (
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from bertforge.serve.options import ServeOptions
from bertforge.serve.server import make_server, url_of
from bertforge.tokenizer import Tokenizer

WORDS = ["the", "a", "of", "and", "in", "is", "was", "film", "movie", "good", "bad", "great", "plot", "quick", "brown",
         "fox", "dog", "jumps", "over", "lazy", "john", "smith", "paris", "lives", "where", "does", "who", ",", ".",
         "?"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
LIMIT = 10  # seconds any single wait may take


def config(**kw) -> BertConfig:
    return BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64, **kw)


def save(model, path: Path, task: dict | None = None) -> Path:
    model.save_pretrained(path)
    Tokenizer(VOCAB, lowercase=True).save_pretrained(path)
    if task is not None:
        (path / "task.json").write_text(json.dumps(task))
    return path


def model_dirs(root: Path) -> dict[str, Path]:
    """Directories of each kind under `root`: pretrained (masked-LM head), classifier, tagger, reader (QA),
    regression, multiple choice."""
    from bertforge.tasks.conll import STANDARD_LABELS

    torch.manual_seed(0)
    mlm = BertForMaskedLM(config())
    with torch.no_grad():  # a random head is nearly uniform; sharpen it so the top-k order means something
        mlm.cls.predictions.bias.normal_(0, 3)
    labels = ["negative", "positive"]
    clf = BertForSequenceClassification(config(num_labels=2, id2label=dict(enumerate(labels)), task="csv"))
    ner = BertForTokenClassification(config(num_labels=len(STANDARD_LABELS)))
    with torch.no_grad():  # every word B-PER, so every word is an entity
        ner.classifier.weight.zero_()
        ner.classifier.bias[STANDARD_LABELS.index("B-PER")] = 5.0
    spec = {"options": {}, "max_length": 32}
    return {
        "mlm": save(mlm, root / "mlm"),
        "clf": save(clf, root / "clf", {**spec, "task": "csv", "kind": "classification", "labels": labels}),
        "ner": save(ner, root / "ner", {**spec, "task": "conll2003", "kind": "token_classification",
                                        "labels": list(STANDARD_LABELS)}),
        "qa": save(BertForQuestionAnswering(config(num_labels=2)), root / "qa",
                   {**spec, "task": "squad", "kind": "question_answering", "labels": None}),
        "reg": save(BertForSequenceClassification(config(num_labels=1)), root / "reg",
                    {**spec, "task": "stsb", "kind": "regression", "labels": None}),
        "mc": save(BertForMultipleChoice(config(num_labels=1)), root / "mc",
                   {**spec, "task": "swag", "kind": "multiple_choice", "labels": None}),
    }


def post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=LIMIT, **kw)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + LIMIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def running(model_dir, **options):
    """A server on a free loopback port, in this process: (its URL, the app's state)."""
    server, sock = make_server(ServeOptions(model=str(model_dir), port=0, **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + LIMIT
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield url_of(sock), server.config.app.state
    finally:
        server.should_exit = True
        thread.join(LIMIT)
        assert not thread.is_alive()


class Gate:
    """Holds the engine's worker at its next call until `open`: what is sent meanwhile waits in the queue."""

    def __init__(self, state):
        self.batcher, self.calls = state.batcher, []
        self.run, self.released, self.entered = self.batcher._run, threading.Event(), threading.Event()

    def __enter__(self):
        def held(key, items):
            self.calls.append(len(items))
            self.entered.set()
            assert self.released.wait(LIMIT)
            return self.run(key, items)

        self.batcher._run = held
        return self

    def open(self):
        self.released.set()

    def __exit__(self, *exc):
        self.released.set()
        self.batcher._run = self.run
