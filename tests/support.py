"""Helpers that several test files share (no tests, no fixtures: those are in conftest.py): a small synthetic
corpus, a tokenizer trained on it and data prepared with it (once per session), a bound for sampled proportions,
and the digests of a tree of files (to show that a command left its inputs alone); the `gpu` mark, a right-padded
mask and the names of a loss's autograd nodes."""

from __future__ import annotations

import atexit
import functools
import hashlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

_WORDS_TEXT = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have "
         "an they you were her she there been one all we their has would when if so no will more can some "
         "government congress nation people states united year country public treaty commerce revenue "
         "territory legislation department secretary treasury navy army expenditure appropriation "
         "constitution president citizens peace war law duty important measures subject attention")
WORDS = _WORDS_TEXT.split(" ")


def make_documents(n_docs: int, seed: int = 0, *, min_sents: int = 3, max_sents: int = 40) -> list[list[str]]:
    """Documents as lists of sentences: random words, capitalised, ending with a period."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        sents = []
        for _ in range(int(rng.integers(min_sents, max_sents + 1))):
            words = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(3, 25)))]
            sents.append(" ".join(words).capitalize() + ".")
        docs.append(sents)
    return docs


def pseudo_documents(n_docs: int, seed: int = 0, *, sentences: int = 75, lexicon_size: int = 6000) -> list[list[str]]:
    """Documents as lists of sentences over a lexicon of pronounceable pseudo-words drawn with Zipf frequencies:
    enough distinct words for a 2k WordPiece vocabulary, which `make_documents`' short word list cannot give."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    lexicon = sorted({"".join(rng.choice(syllables, int(rng.integers(1, 4)))) for _ in range(lexicon_size)})
    rng.shuffle(lexicon)
    zipf = 1.0 / np.arange(1, len(lexicon) + 1)
    zipf /= zipf.sum()
    return [[" ".join(lexicon[i] for i in rng.choice(len(lexicon), int(rng.integers(5, 25)), p=zipf)).capitalize()
             + "." for _ in range(sentences)] for _ in range(n_docs)]


def write_doc_corpus(directory: Path, docs: list[list[str]]) -> Path:
    """One document per file, paragraphs of up to 4 sentences separated by blank lines."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        paras = [" ".join(doc[j:j + 4]) for j in range(0, len(doc), 4)]
        (directory / f"doc-{i:04d}.txt").write_text("\n\n".join(paras) + "\n")
    return directory


def write_lines_corpus(path: Path, docs: list[list[str]]) -> Path:
    """BERT's format: one sentence per line, a blank line between documents."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join("\n".join(d) for d in docs) + "\n")
    return path


def _session_directory(prefix: str) -> Path:
    """A temporary directory that lives until this test process exits (then it is removed, with all in it)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def tokenizer_dir() -> Path:
    """A tokenizer (vocab 400, so many words are split into ## pieces) trained on a synthetic corpus."""
    from bertforge.tokenizer import Tokenizer, VocabOptions

    root = _session_directory("bertforge-test-data-")
    corpus = write_lines_corpus(root / "train.txt", make_documents(60, seed=99))
    tok = Tokenizer.train([corpus], VocabOptions(vocab_size=400, min_frequency=1), show_progress=False)
    tok.save_pretrained(root / "tok")
    return root / "tok"


def tokenizer():
    from bertforge.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tokenizer_dir())


@functools.cache
def prepared_dir(n_docs: int = 80, max_seq_len: int = 64, val_fraction: float = 0.1) -> Path:
    """Prepared data of a synthetic doc-per-file corpus (made once per session and argument set)."""
    from bertforge.data.prepare import PrepareOptions, prepare

    root = _session_directory("bertforge-test-prepared-")
    corpus = write_doc_corpus(root / "corpus", make_documents(n_docs, seed=1))
    prepare([str(corpus)], str(tokenizer_dir()), root / "data",
            PrepareOptions(max_seq_len=max_seq_len, val_fraction=val_fraction), workers=1, progress=False)
    return root / "data"


def binomial_bound(n: int, p: float, sigmas: float = 5.0) -> float:
    """Half-width of a `sigmas`-sigma interval for a proportion estimated from n Bernoulli(p) draws."""
    return sigmas * float(np.sqrt(p * (1 - p) / n))


def file_digests(*paths: Path) -> dict[str, str]:
    """Every file under `paths` and its SHA-256 (a run directory's .lock holds the last pid: not content)."""
    found = {}
    for top in paths:
        for p in sorted([top] if top.is_file() else top.rglob("*")):
            if p.is_file() and p.name != ".lock":
                found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def pretrain_config(data, out, *, loop, model: str = "mini", data_options=None, electra=None, minutes=None,
                    warmup_fraction=None, resume: bool = False, **fields):
    """A `PretrainConfig` with everything as given (no recipe fills anything): `loop` and `data_options` as they
    are, the other keywords by their field names in the config's sections (`init`, `dropout`, `bow_weight`,
    `stack_fraction` ...; stacking's without its `stack_` prefix is not accepted: give `stack_fraction`)."""
    import dataclasses

    from bertforge.options import DataOptions, ElectraOptions
    from bertforge.pretrain.config import BudgetSpec, ModelSpec, ObjectiveSpec, PretrainConfig, StackingSpec

    def take(cls, prefix=""):
        names = {f.name for f in dataclasses.fields(cls)}
        return {name: fields.pop(prefix + name) for name in list(names) if prefix + name in fields}

    if fields.get("init") is not None:
        fields["init"] = str(fields["init"])
    model_spec = ModelSpec(name=str(model), **take(ModelSpec))
    stacking = StackingSpec(**take(StackingSpec, "stack_"))
    objective = ObjectiveSpec(**take(ObjectiveSpec), electra=electra or ElectraOptions())
    if fields:
        raise TypeError(f"pretrain_config: unknown fields {sorted(fields)}")
    return PretrainConfig(data_dir=str(data), out_dir=str(out), loop=loop, data=data_options or DataOptions(),
                          model=model_spec, objective=objective, stacking=stacking,
                          budget=BudgetSpec(minutes=minutes, warmup_fraction=warmup_fraction), resume=resume)


def gpu(test):
    """Mark a test `cuda` and skip it, saying why, where there is no CUDA device."""
    reason = "needs a CUDA device: on a GPU machine run `pytest -m cuda`"
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)(test))


def right_padded(lengths: list[int], T: int) -> torch.Tensor:
    """A (B, T) bool mask, True at each sequence's first `lengths[b]` positions."""
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def backward_nodes(loss: torch.Tensor) -> list[str]:
    """The type names of every autograd node `loss` was computed through."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_fn for next_fn, _ in node.next_functions)
    return [type(node).__name__ for node in seen]
