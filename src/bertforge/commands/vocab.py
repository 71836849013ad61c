"""`bertforge vocab train`: learn a WordPiece vocabulary from a corpus."""

from __future__ import annotations

from dataclasses import dataclass

from bertforge.commands.base import Command, arg, at_least

DESCRIPTION = """Learn a BERT WordPiece vocabulary from a corpus and measure how well it covers it.

Streams the corpus (never loads it whole) and counts on all cores. Writes vocab.txt (one token per line,
[PAD] [UNK] [CLS] [SEP] [MASK] first, [PAD] = 0), tokenizer.json, tokenizer_config.json and
vocab_summary.json (the arguments and the coverage figures printed at the end).

examples:
  bertforge vocab train --corpus texts/ --vocab-size 30522 --out tok/
  bertforge vocab train --corpus 'wiki/**/*.jsonl.gz' books.txt --vocab-size 8000 --cased --out tok-cased/
"""


@dataclass
class VocabTrainArgs:
    corpus: list[str] = arg(help="corpus files, directories or globs: .txt (one text per line) or .jsonl with a "
                                 "'text' field, optionally .gz", metavar="PATH")
    out: str = arg(help="output directory")
    vocab_size: int = arg(30522, help="number of tokens, special tokens included",
                          bound=at_least(6, "the 5 special tokens and at least one piece"))
    cased: bool = arg(False, help="keep case and accents (default: lowercase and strip accents, 'uncased')")
    min_frequency: int = arg(2, help="merge only pieces that occur together at least this often", bound=at_least(1))
    limit_alphabet: int = arg(1000, help="keep at most this many distinct characters; rarer ones become [UNK]",
                              bound=at_least(1))
    progress: bool = arg(True, help="show progress bars")


def vocab_train(args: VocabTrainArgs) -> None:
    import dataclasses
    import time
    from pathlib import Path

    from bertforge.errors import BertforgeError
    from bertforge.io import write_json
    from bertforge.tokenizer import Tokenizer, corpus_files, corpus_summary, iter_corpus_texts

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BertforgeError(f"--out {out} is a file; give a directory to write the vocabulary into")
    _refuse_model_or_data(out)
    files = corpus_files(args.corpus)
    size = sum(f.stat().st_size for f in files)
    print(f"corpus: {len(files):,} file{'s' * (len(files) != 1)}, {size / 1e6:,.1f} MB")
    start = time.perf_counter()
    tok = Tokenizer.train(files, vocab_size=args.vocab_size, lowercase=not args.cased,
                          min_frequency=args.min_frequency, limit_alphabet=args.limit_alphabet,
                          show_progress=args.progress)
    seconds = time.perf_counter() - start
    tok.save_pretrained(out)
    print(f"vocabulary: {tok.vocab_size:,} tokens ({'uncased' if tok.lowercase else 'cased'}) in {seconds:.1f} s "
          f"-> {out}/vocab.txt")
    if tok.vocab_size < args.vocab_size:
        print(f"  (fewer than the {args.vocab_size:,} asked: the corpus has no more pieces seen "
              f"{args.min_frequency}+ times; add text or lower --min-frequency)")
    summary = corpus_summary(tok, iter_corpus_texts(files))
    write_json(out / "vocab_summary.json", {
        "command": "vocab train", "args": dataclasses.asdict(args), "files": len(files), "bytes": size,
        "train_seconds": round(seconds, 2), "fingerprint": tok.fingerprint, **summary})
    print(f"coverage, measured on {summary['words']:,} words of the corpus:")
    print(f"  single-token words: {summary['single_token_words']:.1%}")
    print(f"  tokens per word:    {summary['tokens_per_word']:.3f}")
    print(f"  [UNK] rate:         {summary['unk_rate']:.3%} of tokens")
    print(f"summary: {out}/vocab_summary.json")


# a model directory's tokenizer must stay the one its weights were trained with; prepared data's, its tokens'
HOLDERS = {"config.json": "a model", "model.safetensors": "a model", "pytorch_model.bin": "a model",
           "model.safetensors.index.json": "a model", "manifest.json": "prepared data"}


def _refuse_model_or_data(out) -> None:
    from bertforge.errors import BertforgeError

    for name, what in HOLDERS.items():
        if (out / name).is_file():
            raise BertforgeError(f"--out {out} holds {what} ({name}); a new vocabulary there would no longer "
                                 f"match it: choose another directory")


COMMANDS = [
    Command("vocab train", VocabTrainArgs, vocab_train, help="learn a WordPiece vocabulary from a corpus",
            description=DESCRIPTION),
]
