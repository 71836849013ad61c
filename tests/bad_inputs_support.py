"""What the bad-input tests share (test_bad_inputs*.py): a small corpus, the pretraining command line they run,
the toy run (conftest's `toy` fixture), a labelled CSV task, and `refused`, the check that a command ends in one
error line and leaves its inputs alone."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from support import file_digests

from bertforge.cli import main
from bertforge.tokenizer import Tokenizer

WORDS = ["the", "a", "of", "river", "stone", "north", "winter", "light", "market", "king", "ship", "garden",
         "letter", "old", "new", "quiet", "bright", "road", "village", "tower", "song", "bread", "field", "iron",
         "cloud", "glass", "paper", "summer", "station", "forest", "harbour"]
LATIN1 = "caf\xe9 au lait".encode("latin-1")


def write_corpus(root: Path) -> Path:
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for d in range(3):
        docs = []
        for _ in range(12):
            sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + "."
                         for _ in range(rng.randint(3, 6))]
            docs.append("\n".join(sentences))
        (corpus / f"part{d}.txt").write_text("\n\n".join(docs) + "\n")
    return corpus


def pretrain_args(data: Path, out: Path, *extra: str, steps: int = 6) -> list[str]:
    return ["pretrain", "--data", str(data), "--out", str(out), "--model", "tiny", "--steps", str(steps),
            "--batch-size", "4", "--lr", "1e-3", "--warmup-steps", "1", "--save-every", "2", "--log-every", "2",
            "--eval-batches", "0", "--no-progress", "--device", "cpu", *extra]


def make_toy(root: Path) -> dict[str, Path]:
    """A small corpus; tokenizer A trained on it and tokenizer B, the same tokens with two swapped (same size,
    another identity); data prepared with each; a pretraining run on A's data killed after step 4 of 6."""
    corpus = write_corpus(root)
    assert main(["vocab", "train", "--corpus", str(corpus), "--vocab-size", "200", "--out", str(root / "tok_a"),
                 "--no-progress"]) == 0
    tok_a = Tokenizer.from_pretrained(root / "tok_a")
    vocab = list(tok_a.vocab)
    vocab[-1], vocab[-2] = vocab[-2], vocab[-1]
    Tokenizer(vocab, lowercase=tok_a.lowercase).save_pretrained(root / "tok_b")
    for name in ("a", "b"):
        assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(root / f"tok_{name}"), "--out",
                     str(root / f"data_{name}"), "--max-seq-len", "32", "--val-fraction", "0.1", "--workers", "1",
                     "--no-progress"]) == 0
    run = root / "run"
    assert main(pretrain_args(root / "data_a", run)) == 0
    shutil.rmtree(run / "checkpoints" / "step-6")  # as if killed after the checkpoint at step 4
    return {"root": root, "corpus": corpus, "data_a": root / "data_a", "data_b": root / "data_b", "run": run}


def refused(capsys, argv: list[str], *untouched: Path) -> str:
    """Run the CLI; assert exit 2, exactly one `error:` line on stderr, no traceback, `untouched` unchanged.
    Returns the message."""
    capsys.readouterr()
    before = file_digests(*untouched)
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert file_digests(*untouched) == before
    return lines[0]


def labelled_csv(data: Path) -> Path:
    """A CSV classification task of 31 training rows (4 steps of 8) and 10 dev rows."""
    data.mkdir()
    rows = [f"{w} {v} words,{i % 2}\n" for i, (w, v) in enumerate(zip(WORDS, reversed(WORDS), strict=True))]
    (data / "train.csv").write_text("text,label\n" + "".join(rows))
    (data / "dev.csv").write_text("text,label\n" + "".join(rows[:10]))
    return data
