"""`bertforge prepare` (corpus -> sharded token data), `bertforge join` (the parts of a `prepare --shard` run made
one) and `bertforge inspect` (look at prepared data)."""

from __future__ import annotations

import dataclasses
import json

from bertforge.bounds import FRACTION, MIN_SEQ_LEN, at_least
from bertforge.commands.arguments import Command
from bertforge.options import option, seed_option


@dataclasses.dataclass
class PrepareArgs:
    corpus: list[str] = option(help="corpus files, directories or globs: .txt or .jsonl (plain, .gz, .bz2, .xz or "
                                    ".zst), .parquet, or .arrow (a `datasets.save_to_disk` directory)")
    tokenizer: str = option(help="tokenizer directory (from `bertforge vocab train` or a model directory)")
    out: str = option(help="output directory for the shards and manifest.json")
    max_seq_len: int = option(128, help="sequence length the instances will be made for (BERT: 128, then 512)",
                              bound=MIN_SEQ_LEN)
    workers: int | None = option(None, help="worker processes (default: every core this process may use)",
                                 bound=at_least(1, "more processes than any machine has cores", at_most=1024))
    val_fraction: float = option(0.01, help="fraction of documents held out for validation", bound=FRACTION)
    seed: int = seed_option(12345, help="random seed of the validation split")
    format: str = option("auto", choices=["auto", "doc", "lines"],
                         help=".txt layout: doc (one document per file, paragraphs split into sentences), lines "
                              "(BERT's: one sentence per line, blank line between documents), auto (detect per file)")
    text_field: str = option("text", help="the .jsonl field, or the Parquet or Arrow column, that holds each "
                                          "document's text")
    shard: str | None = option(None, help="I/N: prepare only the I-th of N parts of the corpus (on N machines), "
                                          "then `bertforge join` the N outputs", metavar="I/N")
    overwrite: bool = option(False, help="replace --out even if it holds other data")
    progress: bool = option(True, help="show a progress bar")


def run_prepare(args: PrepareArgs) -> int:
    from bertforge.data.parts import parse_part
    from bertforge.data.prepare import PrepareOptions, prepare, usable_cores

    part = parse_part(args.shard) if args.shard else None
    cores = usable_cores()
    workers = args.workers or cores
    print(f"prepare: {workers} worker process{'es' * (workers != 1)}, {cores} core{'s' * (cores != 1)} usable"
          + ("" if args.workers else " (--workers to change)"))
    options = PrepareOptions(max_seq_len=args.max_seq_len, val_fraction=args.val_fraction, seed=args.seed,
                             format=args.format, text_field=args.text_field)
    m = prepare(args.corpus, args.tokenizer, args.out, options, workers=workers, part=part, overwrite=args.overwrite,
                progress=args.progress)
    print(_counts_text(m))
    print(f"wrote {args.out}" + (f" (part {part[0]} of {part[1]}: `bertforge join` all {part[1]})" if part else ""))
    return 0


@dataclasses.dataclass
class JoinArgs:
    parts: list[str] = option(help="the N directories that `prepare --shard I/N` wrote, in any order",
                              positional=True)
    out: str = option(help="output directory for the joined data")
    overwrite: bool = option(False, help="replace --out even if it holds other data")


def run_join(args: JoinArgs) -> int:
    from bertforge.data.join import join

    m = join(args.parts, args.out, overwrite=args.overwrite)
    print(_counts_text(m))
    print(f"wrote {args.out}")
    return 0


@dataclasses.dataclass
class InspectArgs:
    data: str = option(help="prepared data directory", positional=True)
    split: str = option("train", choices=["train", "val"], help="which split's instances to show")
    num: int = option(3, help="how many instances to decode",
                      bound=at_least(1, "a million printed instances at most", at_most=10**6))
    max_seq_len: int | None = option(None, help="instance length (default: the manifest's)", bound=MIN_SEQ_LEN)
    whole_word_mask: bool = option(False, help="show whole-word masking")
    seed: int = seed_option(12345, help="random seed of the instances and masks")
    epoch: int = option(0, help="epoch whose instances to show",
                        bound=at_least(0, "more than 10**9 epochs is a typo", at_most=10**9))


def run_inspect(args: InspectArgs) -> int:
    from bertforge.data.loader import PretrainingData
    from bertforge.options import DataOptions

    data = PretrainingData(args.data, args.split, DataOptions(whole_word_mask=args.whole_word_mask, seed=args.seed),
                           max_seq_len=args.max_seq_len)
    m = data.manifest
    print(f"{args.data}: tokenizer {m['tokenizer_fingerprint']}, vocab {m['vocab_size']}, "
          f"max_seq_len {m['max_seq_len']}")
    print(_counts_text(m))
    print(f"\n{args.num} instances of epoch {args.epoch} ({args.split}); "
          "[MASK]{x}: masked, t{x}: kept, t{x} where t != x: replaced; {x} is the label")
    for index, inst in enumerate(data.epoch_instances(args.epoch)):
        if index >= args.num:
            break
        ids, labels, _, is_random = data.mask(inst, args.epoch, index)
        print(f"\n{render(data.tokenizer, ids, labels)}  {'NotNext' if is_random else 'IsNext'}")
    return 0


def render(tokenizer, ids, labels) -> str:
    """Tokens of one instance, each predicted one shown as `input{label}`."""
    out = []
    for i, lab in zip(ids, labels, strict=True):
        t = tokenizer.id_to_token(int(i))
        out.append(t if lab < 0 else f"{t}{{{tokenizer.id_to_token(int(lab))}}}")
    return " ".join(out)


def _counts_text(m: dict) -> str:
    lines = []
    for split, c in m["counts"].items():
        lines.append(f"{split}: {c['documents']:,} documents, {c['sentences']:,} sentences, {c['tokens']:,} tokens "
                     f"in {len(m['splits'][split]['shards'])} shard(s)")
    reading = m["reading"]
    counts = {k: v for k, v in reading["counts"].items() if v and k not in ("units", "documents", "sentences")}
    if counts:
        lines.append("reading: " + json.dumps(counts))
    if reading["skipped_files"]:
        lines.append("skipped files: " + ", ".join(f"{n} {why}" for why, n in reading["skipped_files"].items()))
    val_docs = m["counts"].get("val", {}).get("documents", 0)
    if val_docs == 1:
        lines.append("warning: the val split has a single document, so it has no NotNext pairs (B must come from "
                     "another document) and pretraining reports no NSP accuracy; raise --val-fraction")
    return "\n".join(lines)


COMMANDS = [
    Command("prepare", PrepareArgs, run_prepare, help="tokenize a corpus into sharded pretraining data",
            description="""Tokenize a corpus into memory-mapped shards for `bertforge pretrain`.

examples:
  bertforge prepare --corpus texts/ --tokenizer tok/ --out data/
  bertforge prepare --corpus 'wiki/*.jsonl.gz' books.txt --tokenizer tok/ --out data/ --max-seq-len 512
  bertforge prepare --corpus 'fineweb/data/*.parquet' --tokenizer tok/ --out data/
  bertforge prepare --corpus pile/00.jsonl.zst --tokenizer tok/ --out data/
  bertforge prepare --corpus saved_dataset/train/ --text-field content --tokenizer tok/ --out data/
"""),
    Command("join", JoinArgs, run_join, help="join the parts of a `prepare --shard I/N` run into one prepared dataset",
            description="""Join the N parts of a `prepare --shard I/N` run into one prepared dataset, byte-identical to
what `prepare` makes of the whole corpus on one machine. Refuses parts of another run (another tokenizer,
sequence length, N, corpus or settings) and a part missing or given twice.

example (three machines, then one):
  bertforge prepare --corpus 'hub/*.parquet' --tokenizer tok/ --out parts/1 --shard 1/3   # machine 1
  bertforge prepare --corpus 'hub/*.parquet' --tokenizer tok/ --out parts/2 --shard 2/3   # machine 2
  bertforge prepare --corpus 'hub/*.parquet' --tokenizer tok/ --out parts/3 --shard 3/3   # machine 3
  bertforge join parts/1 parts/2 parts/3 --out data/
"""),
    Command("inspect", InspectArgs, run_inspect, help="show counts and decoded instances of prepared data",
            description="""Show the counts of prepared data and a few instances with their masks and labels.

example:
  bertforge inspect data/ --num 5
"""),
]
