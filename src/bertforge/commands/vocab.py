"""`bertforge vocab train`: learn a WordPiece vocabulary from a corpus."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from bertforge.commands.arguments import Command
from bertforge.commands.data import PrepareArgs
from bertforge.errors import BertforgeError
from bertforge.options import VOCAB_SIZE, at_least, option, same_as

DESCRIPTION = """Learn a BERT WordPiece vocabulary from a corpus and measure how well it covers it.

Reads the corpus as `bertforge prepare` does (binary files and repeated paths are skipped, a line of any length
is read in bounded pieces), in two passes: the characters, then the word pieces, counted on all cores. The
same corpus and options give the same vocab.txt in every run. Writes vocab.txt (one token per line,
[PAD] [UNK] [CLS] [SEP] [MASK] first, [PAD] = 0), tokenizer.json, tokenizer_config.json and vocab_summary.json
(the arguments, what reading skipped, and the coverage figures printed at the end).

examples:
  bertforge vocab train --corpus texts/ --vocab-size 30522 --out tok/
  bertforge vocab train --corpus 'wiki/**/*.jsonl.gz' books.txt --vocab-size 8000 --cased --out tok-cased/
  bertforge vocab train --corpus 'wikipedia/20231101.en/*.parquet' --out tok/
"""


@dataclasses.dataclass
class VocabTrainArgs:
    corpus: list[str] = option(help="corpus files, directories or globs: .txt or .jsonl (plain, .gz, .bz2, .xz or "
                                    ".zst), .parquet or .arrow (read as `prepare` reads them)", metavar="PATH")
    out: str = option(help="output directory")
    vocab_size: int = option(30522, help="number of tokens, special tokens included; at least the special tokens, "
                                         "the characters kept and their ## forms",
                             bound=VOCAB_SIZE)
    cased: bool = option(False, help="keep case and accents (default: lowercase and strip accents, 'uncased')")
    min_frequency: int = option(2, help="merge only pieces that occur together at least this often",
                                bound=at_least(1, "more than any corpus holds", at_most=10**12))
    limit_alphabet: int = option(1000, help="keep at most this many distinct characters (the most frequent); "
                                            "rarer ones become [UNK]",
                                bound=at_least(1, "Unicode has 1_114_112 code points", at_most=0x110000))
    text_field: str = same_as(PrepareArgs, "text_field")
    progress: bool = option(True, help="show progress bars")


def vocab_train(args: VocabTrainArgs) -> None:
    from bertforge.corpus import ReadStats, expand_inputs, read_sentences
    from bertforge.files import write_json
    from bertforge.tokenizer import Tokenizer, VocabOptions, corpus_summary

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BertforgeError(f"--out {out} is a file; give a directory to write the vocabulary into")
    _refuse_model_or_data(out)
    stats = ReadStats()
    files = expand_inputs(args.corpus, stats)
    size = sum(f.stat().st_size for f in files)
    print(f"corpus: {len(files):,} file{'s' * (len(files) != 1)}, {size / 1e6:,.1f} MB")
    start = time.perf_counter()
    options = VocabOptions(vocab_size=args.vocab_size, lowercase=not args.cased, min_frequency=args.min_frequency,
                           limit_alphabet=args.limit_alphabet, text_field=args.text_field)
    tok = Tokenizer.train(files, options, show_progress=args.progress, strict=True, stats=stats)
    seconds = time.perf_counter() - start
    tok.save_pretrained(out)
    reading = stats.summary()
    if reading["skipped_files"]:
        print("skipped: " + ", ".join(f"{n} {why}" for why, n in reading["skipped_files"].items()))
    replaced = reading["counts"].get("invalid_utf8_bytes_replaced", 0)
    if replaced:  # as `prepare` reads them: U+FFFD, which the tokenizer drops
        print(f"not UTF-8: {replaced:,} byte{'s' * (replaced != 1)} read as U+FFFD and dropped; convert the corpus "
              f"to UTF-8 to learn those characters")
    print(f"vocabulary: {tok.vocab_size:,} tokens ({'uncased' if tok.lowercase else 'cased'}) in {seconds:.1f} s "
          f"-> {out}/vocab.txt")
    if tok.vocab_size < args.vocab_size:
        print(f"  ({args.vocab_size - tok.vocab_size:,} fewer than the {args.vocab_size:,} asked: the corpus has no "
              f"more pairs of pieces seen {args.min_frequency}+ times; add text or lower --min-frequency)")
    summary = corpus_summary(tok, read_sentences(files, text_field=args.text_field))
    write_json(out / "vocab_summary.json", {
        "command": "vocab train", "args": dataclasses.asdict(args), "files": len(files), "bytes": size,
        "train_seconds": round(seconds, 2), "fingerprint": tok.fingerprint, "vocab_size_asked": args.vocab_size,
        "reading": reading, **summary})
    print(f"coverage, measured on {summary['words']:,} words of the corpus:")
    print(f"  single-token words: {summary['single_token_words']:.1%}")
    print(f"  tokens per word:    {summary['tokens_per_word']:.3f}")
    print(f"  [UNK] rate:         {summary['unk_rate']:.3%} of tokens")
    print(f"summary: {out}/vocab_summary.json")


# a model directory's tokenizer must stay the one its weights were trained with; prepared data's, its tokens'
HOLDERS = {"config.json": "a model", "model.safetensors": "a model", "pytorch_model.bin": "a model",
           "model.safetensors.index.json": "a model", "manifest.json": "prepared data"}


def _refuse_model_or_data(out: Path) -> None:
    for name, what in HOLDERS.items():
        if (out / name).is_file():
            raise BertforgeError(f"--out {out} holds {what} ({name}); a new vocabulary there would no longer "
                                 f"match it: choose another directory")


COMMANDS = [
    Command("vocab train", VocabTrainArgs, vocab_train, help="learn a WordPiece vocabulary from a corpus",
            description=DESCRIPTION),
]
