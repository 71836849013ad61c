"""`vocab train`: the same vocab.txt in every process, the corpus read as `prepare` reads it (binary files and
repeated paths skipped and counted, a huge line in bounded memory), and vocabulary sizes it cannot honour."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from bertforge.cli import main
from bertforge.errors import BertforgeError
from bertforge.tokenizer import SPECIAL_TOKENS, Tokenizer, VocabOptions, count_alphabet, training
from bertforge.tokenizer.coverage import word_pieces
from bertforge.tokenizer.vocab import MAX_VOCAB_SIZE

# Letters with many equal counts (so the trainer meets ties among characters and among pairs), some of them
# outside ASCII (the normalizer's path) and some only ever first in a word (no ## form).
LETTERS = "abcdefghijklmnopqrstuvwxyzéßøΣλжあ"


def _write_corpus(root, n_words: int = 6000, seed: int = 0):
    rng = random.Random(seed)
    words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 7))) for _ in range(400)]
    root.mkdir(parents=True, exist_ok=True)
    text = " ".join(rng.choice(words) for _ in range(n_words))
    (root / "a.txt").write_text("\n".join(textwrap.wrap(text, 70)) + "\n", encoding="utf-8")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in textwrap.wrap(text[::-1], 200)),
                                  encoding="utf-8")
    return root


def _train_in_a_process(corpus, out, env: dict[str, str]) -> bytes:
    r = subprocess.run([sys.executable, "-m", "bertforge", "vocab", "train", "--corpus", str(corpus), "--out", str(out),
                        "--vocab-size", "400", "--limit-alphabet", "30", "--min-frequency", "1", "--no-progress"],
                       capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return (out / "vocab.txt").read_bytes()


@pytest.mark.slow  # subprocesses
def test_the_same_corpus_gives_a_byte_identical_vocab_txt_in_separate_processes(tmp_path):
    """The engine's trainer alone numbers pieces in a hash order seeded anew in every process: before the fix
    these two runs gave different files (different token sets, not only orders). Different hash seeds, and
    one run with the engine's threads off."""
    corpus = _write_corpus(tmp_path / "corpus")
    first = _train_in_a_process(corpus, tmp_path / "one", {"PYTHONHASHSEED": "1", "TOKENIZERS_PARALLELISM": "false"})
    second = _train_in_a_process(corpus, tmp_path / "two", {"PYTHONHASHSEED": "2", "TOKENIZERS_PARALLELISM": "true"})
    assert first == second
    vocab = first.decode().split("\n")[:-1]
    assert len(vocab) == 400 and vocab[:5] == list(SPECIAL_TOKENS)


def test_the_vocabulary_starts_with_the_alphabet_in_code_point_order(tmp_path):
    corpus = _write_corpus(tmp_path / "corpus")
    tok = Tokenizer.train(corpus, VocabOptions(vocab_size=400, limit_alphabet=30, min_frequency=1), show_progress=False)
    alphabet = count_alphabet([(corpus / "a.txt").read_text(encoding="utf-8"),
                               *(json.loads(line)["text"] for line in (corpus / "b.jsonl").open(encoding="utf-8"))],
                              lowercase=True, limit_alphabet=30)
    n = len(alphabet.initial_tokens)
    assert tok.vocab[:n] == alphabet.initial_tokens
    assert alphabet.chars == sorted(alphabet.chars) and len(alphabet.chars) == 30
    assert alphabet.continuations == sorted(alphabet.continuations)
    assert not {"Σ", "é"} & set(alphabet.chars)  # counted as the engine sees them: lowercased, accents stripped
    assert all(not t.startswith("##") or len(t) > 3 for t in tok.vocab[n:])  # the rest are learned pieces


def test_count_alphabet_keeps_the_most_frequent_and_breaks_ties_by_code_point():
    # c: 3, a: 2, b: 2, d: 1, "!" 1 (a word of its own); "ba" and "ab" put a and b inside a word
    texts = ["ba ab", "c c c!", "d"]
    a = count_alphabet(texts, lowercase=True, limit_alphabet=2)
    assert a.chars == ["a", "c"] and a.continuations == ["##a"] and a.dropped == 3  # a beats b on the tie
    a = count_alphabet(texts, lowercase=True, limit_alphabet=10)
    assert a.chars == ["!", "a", "b", "c", "d"] and a.continuations == ["##a", "##b"] and a.dropped == 0
    assert count_alphabet(["Ab\x00c\tÉ\u0301"], lowercase=True, limit_alphabet=10).chars == ["a", "b", "c", "e"]
    assert count_alphabet(["Ab\x00c\tÉ"], lowercase=False, limit_alphabet=10).chars == ["A", "b", "c", "É"]


def test_binary_files_and_repeated_paths_are_skipped_and_counted(tmp_path, capsys):
    corpus = _write_corpus(tmp_path / "corpus")
    (corpus / "b.jsonl").unlink()
    (corpus / "image.txt").write_bytes(bytes(range(256)) * 40)  # a binary file with a text name
    args = ["vocab", "train", "--vocab-size", "300", "--min-frequency", "1", "--no-progress"]
    assert main([*args, "--corpus", str(corpus), str(corpus / "a.txt"), "--out", str(tmp_path / "tok")]) == 0
    printed = capsys.readouterr().out
    assert "skipped: 1 binary file, 1 duplicate path" in printed
    summary = json.loads((tmp_path / "tok" / "vocab_summary.json").read_text())
    assert summary["reading"]["skipped_files"] == {"binary file": 1, "duplicate path": 1}
    # Neither changed what was learned: the same vocabulary as from the text file alone, read once.
    assert main([*args, "--corpus", str(corpus / "a.txt"), "--out", str(tmp_path / "alone")]) == 0
    assert (tmp_path / "tok" / "vocab.txt").read_bytes() == (tmp_path / "alone" / "vocab.txt").read_bytes()


MEASURE = """
import json, resource, sys
from bertforge.tokenizer import Tokenizer, VocabOptions
from bertforge.tokenizer.engine import pipeline
pipeline(True)  # the Unicode classes and the engine's regexes, before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
Tokenizer.train([sys.argv[1]], VocabOptions(vocab_size=500), show_progress=False)
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024))
"""


@pytest.mark.slow  # a subprocess
def test_a_huge_single_line_is_learned_from_in_bounded_memory(tmp_path):
    """The old reader handed the engine a whole line: 533 MB more peak memory for an 8 MB line (8.1 GB for
    50 MB). Read in pieces as `prepare` reads it, the peak does not grow with the line (measured: +20-50 MB
    for lines of 3, 8 and 20 MB); here 4 MB, where the old reader took about 270 MB."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    line = []
    size = 0
    while size < 4_000_000:
        sentence = " ".join(rng.choice(words) for _ in range(12)).capitalize() + ". "
        line.append(sentence)
        size += len(sentence)
    path = tmp_path / "one-line.txt"
    path.write_text("".join(line) + "\n")
    r = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    grown_mb = json.loads(r.stdout)
    assert grown_mb < 120, grown_mb


def test_an_impossible_vocab_size_is_one_error_line(tmp_path, capsys):
    corpus = _write_corpus(tmp_path / "corpus")
    out = tmp_path / "tok"
    args = ["vocab", "train", "--corpus", str(corpus), "--min-frequency", "1", "--no-progress"]
    assert main([*args, "--out", str(out), "--vocab-size", "20"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: vocab size 20 is too small for this corpus") and err.count("\n") == 1
    assert "Traceback" not in err and not (out / "vocab.txt").exists()
    least = int(err.split("ask for at least ")[1].split()[0])
    assert main([*args, "--out", str(out), "--vocab-size", str(least - 1)]) == 2
    capsys.readouterr()
    assert main([*args, "--out", str(out), "--vocab-size", str(least)]) == 0  # the alphabet alone, as many as asked
    assert len((out / "vocab.txt").read_text(encoding="utf-8").splitlines()) == least
    # Fewer characters make room: the error's other way out.
    assert main([*args, "--vocab-size", "20", "--limit-alphabet", "5", "--out", str(tmp_path / "few")]) == 0


def test_the_library_gives_the_alphabet_when_asked_for_less_unless_strict(tmp_path):
    corpus = _write_corpus(tmp_path / "corpus")
    tok = Tokenizer.train(corpus, VocabOptions(vocab_size=20, min_frequency=1), show_progress=False)
    assert tok.vocab_size > 20  # documented: the alphabet alone, larger than asked
    with pytest.raises(BertforgeError, match=f"ask for at least {tok.vocab_size} "):
        Tokenizer.train(corpus, VocabOptions(vocab_size=20, min_frequency=1), show_progress=False, strict=True)


def test_a_size_the_corpus_cannot_fill_is_reported(tmp_path, capsys):
    corpus = _write_corpus(tmp_path / "corpus", n_words=300)
    out = tmp_path / "tok"
    assert main(["vocab", "train", "--corpus", str(corpus), "--vocab-size", "5000", "--min-frequency", "2",
                 "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "vocab_summary.json").read_text())
    assert summary["vocab_size_asked"] == 5000 and summary["vocab_size"] < 5000
    assert summary["vocab_size"] == len((out / "vocab.txt").read_text(encoding="utf-8").splitlines())
    printed = capsys.readouterr().out
    assert f"{5000 - summary['vocab_size']:,} fewer than the 5,000 asked" in printed


@pytest.mark.parametrize("content", [b"", b"\n \n\t\n", b'{"title": "no text field"}\n', b"\x00\x01\x02" * 50])
def test_a_corpus_without_text_is_one_error_line(tmp_path, capsys, content):
    """As `prepare` refuses it: no vocabulary of the special tokens alone."""
    corpus = tmp_path / ("corpus.jsonl" if content.startswith(b"{") else "corpus.txt")
    corpus.write_bytes(content)
    out = tmp_path / "tok"
    assert main(["vocab", "train", "--corpus", str(corpus), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no text to learn from in 1 corpus file(s)") and err.count("\n") == 1
    assert not out.exists()


def test_text_that_is_not_utf8_is_read_as_prepare_reads_it(tmp_path, capsys):
    """Each byte that is not UTF-8 becomes U+FFFD and is counted, the rest of the file is learned from: the counts
    `vocab train` reports are the ones in the manifest `prepare` writes from the same file."""
    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes("Le caf\xe9 est ouvert. Le gar\xe7on est l\xe0.\nIl fait beau.\n".encode("latin-1"))
    out = tmp_path / "tok"
    assert main(["vocab", "train", "--corpus", str(corpus), "--out", str(out), "--vocab-size", "60",
                 "--min-frequency", "1", "--no-progress"]) == 0
    assert "not UTF-8: 3 bytes read as U+FFFD and dropped" in capsys.readouterr().out
    vocab = (out / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert "\ufffd" not in vocab and {"c", "f", "g", "r"} <= set(vocab)  # "caf", "gar" learned, the rest too
    learned = json.loads((out / "vocab_summary.json").read_text())["reading"]["counts"]
    assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(out), "--out", str(tmp_path / "data"),
                 "--workers", "1", "--no-progress"]) == 0
    prepared = json.loads((tmp_path / "data" / "manifest.json").read_text())["reading"]["counts"]
    assert learned["invalid_utf8_bytes_replaced"] == prepared["invalid_utf8_bytes_replaced"] == 3
    assert learned["sentences"] == prepared["sentences"] == 3


def test_the_summary_encodes_long_texts_in_pieces_cut_at_spaces():
    text = " ".join(f"w{i}" for i in range(5000))
    pieces = list(word_pieces(["short", text, "x" * 50], 100))
    assert pieces[0] == "short" and pieces[-1] == "x" * 50
    assert "".join(pieces[1:-1]) == text
    assert all(len(p) <= 100 for p in pieces)
    assert all(p.startswith(" ") for p in pieces[2:-1])  # every cut is at a space: no word is split


# -- training from files, and the command --------------------------------------------------------------

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "A lazy dog sleeps; the quick fox runs!",
             "Dogs and foxes: quick, lazy, brown."]


def _corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("\n".join(SENTENCES * 20) + "\n\n", encoding="utf-8")
    with gzip.open(root / "sub" / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for s in SENTENCES * 20:
            f.write(json.dumps({"text": s, "id": 1}) + "\n")
    (root / "notes.md").write_text("ignored")
    return root


def test_train(tmp_path):
    root = _corpus(tmp_path)
    tok = Tokenizer.train(root, VocabOptions(vocab_size=200, min_frequency=1), show_progress=False)
    assert tok.vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert tok.lowercase and tok.vocab_size <= 200 and len(set(tok.vocab)) == tok.vocab_size
    assert "quick" in tok.vocab and "The" not in tok.vocab and "the" in tok.vocab
    assert tok.encode("The QUICK fox.", add_special_tokens=False).tokens == ["the", "quick", "fox", "."]
    cased = Tokenizer.train([root / "a.txt"], VocabOptions(vocab_size=200, lowercase=False, min_frequency=1),
                            show_progress=False)
    assert "The" in cased.vocab and not cased.lowercase
    with pytest.raises(BertforgeError, match="too small"):
        Tokenizer.train(root, VocabOptions(vocab_size=5))


def test_vocab_train_command(tmp_path, capsys):
    root = _corpus(tmp_path)
    out = tmp_path / "tok"
    assert main(["vocab", "train", "--corpus", str(root / "a.txt"), str(root / "sub"), "--vocab-size", "100",
                 "--min-frequency", "1", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "corpus: 2 files" in printed and "single-token words:" in printed and "[UNK] rate:" in printed
    summary = json.loads((out / "vocab_summary.json").read_text())
    assert summary["words"] == 40 * (10 + 10 + 10)  # each sentence is 10 words, punctuation included
    assert summary["args"]["vocab_size"] == 100 and summary["vocab_size"] == len(
        (out / "vocab.txt").read_text().splitlines())
    tok = Tokenizer.from_pretrained(out)
    assert tok.lowercase and tok.fingerprint == summary["fingerprint"]
    assert (out / "tokenizer.json").is_file()


def test_vocab_train_command_errors(tmp_path, capsys):
    assert main(["vocab", "train", "--corpus", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: corpus path '{tmp_path / 'none'}' matches no file") and err.count("\n") == 1


@pytest.mark.parametrize(("name", "what"), [("config.json", "a model"), ("model.safetensors", "a model"),
                                            ("manifest.json", "prepared data")])
def test_vocab_train_refuses_a_directory_with_a_model_or_data(tmp_path, capsys, name, what):
    root = _corpus(tmp_path)
    out = tmp_path / "holder"
    out.mkdir()
    (out / name).write_bytes(b"{}")
    (out / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nkeep\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["vocab", "train", "--corpus", str(root / "a.txt"), "--vocab-size", "100", "--min-frequency", "1",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} holds {what} ({name})") and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    tok = tmp_path / "tok"  # a tokenizer directory alone may be trained again
    for _ in range(2):
        assert main(["vocab", "train", "--corpus", str(root / "a.txt"), "--vocab-size", "100", "--min-frequency",
                     "1", "--out", str(tok), "--no-progress"]) == 0


def test_a_vocab_size_past_the_cap_is_one_error_line_before_reading(tmp_path, capsys):
    # 1e9 once reached the engine, which tried to reserve 70 GB and aborted the process.
    # The flag's bound (2**22) refuses it as the command line is read; a size past the library's cap
    # (MAX_VOCAB_SIZE) but within the bound is refused by the library, also before reading.
    corpus = _write_corpus(tmp_path / "corpus")
    out = tmp_path / "tok"
    for size, says in (("1000000000", "error: argument --vocab-size: must be in [6, 4_194_304], not 1000000000"),
                       ("2000000", "error: vocab size 2,000,000 is over the cap of 1,000,000")):
        assert main(["vocab", "train", "--corpus", str(corpus), "--vocab-size", size, "--no-progress",
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(says) and err.count("\n") == 1
        assert not out.exists()


def test_the_engine_is_asked_for_no_more_than_the_corpus_can_give(tmp_path, monkeypatch):
    corpus = _write_corpus(tmp_path / "corpus", n_words=300)
    asked = []
    real = training.trainers.WordPieceTrainer
    monkeypatch.setattr(training.trainers, "WordPieceTrainer", lambda **kw: asked.append(kw) or real(**kw))
    small = Tokenizer.train(corpus, VocabOptions(vocab_size=5000, min_frequency=1), show_progress=False)
    big = Tokenizer.train(corpus, VocabOptions(vocab_size=MAX_VOCAB_SIZE, min_frequency=1), show_progress=False)
    assert big.vocab == small.vocab  # the same vocabulary: the corpus ran out of merges first
    # 300 words of at most 7 letters, twice (a.txt and b.jsonl): at most 4,200 characters of words
    assert len(small.vocab) < asked[1]["vocab_size"] < len(small.vocab) + 4200
