"""The baseline for bench/prepare.py: a single-process, whole-corpus-in-memory pipeline in the manner of
google-research/bert's create_pretraining_data.py (written here from its description, not copied).

All documents are read into memory, every sentence is tokenized with the pure-Python reference WordPiece
tokenizer (transformers' BertTokenizerLegacy, the port of Google's tokenization.py), then instances are
created and masked for `dupe_factor` copies of the corpus, all held in memory, and written at the end.
The sentence splitter is ours (the original expects pre-split lines), so both sides split the same way.

    python bench/prepare_baseline.py CORPUS_DIR TOKENIZER_DIR OUT_FILE [--dupe-factor 1]
"""

from __future__ import annotations

import argparse
import pickle
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bertforge.corpus.sentences import split_sentences  # noqa: E402


def read_documents(corpus: Path, tokenizer) -> list[list[list[int]]]:
    documents = []
    for path in sorted(corpus.rglob("*.txt")):
        document = []
        for paragraph in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            for sentence in split_sentences(paragraph):
                ids = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(sentence))
                if ids:
                    document.append(ids)
        if document:
            documents.append(document)
    return documents


def truncate_seq_pair(a, b, max_num_tokens, rng):
    while len(a) + len(b) > max_num_tokens:
        trunc = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del trunc[0]
        else:
            trunc.pop()


def instances_from_document(docs, index, max_seq_length, short_seq_prob, rng):
    document = docs[index]
    max_num_tokens = max_seq_length - 3
    target = rng.randint(2, max_num_tokens) if rng.random() < short_seq_prob else max_num_tokens
    out, chunk, length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = [t for seg in chunk[:a_end] for t in seg]
            b = []
            if len(chunk) == 1 or rng.random() < 0.5:
                is_random = True
                for _ in range(10):
                    r = rng.randint(0, len(docs) - 1)
                    if r != index:
                        break
                other = docs[r]
                for j in range(rng.randint(0, len(other) - 1), len(other)):
                    b.extend(other[j])
                    if len(b) >= target - len(a):
                        break
                i -= len(chunk) - a_end
            else:
                is_random = False
                b = [t for seg in chunk[a_end:] for t in seg]
            truncate_seq_pair(a, b, max_num_tokens, rng)
            out.append((a, b, is_random))
            chunk, length = [], 0
        i += 1
    return out


def mask(tokens, vocab_size, specials, rng, masked_lm_prob=0.15, max_predictions=20, mask_id=4):
    cand = [i for i, t in enumerate(tokens) if t not in specials]
    rng.shuffle(cand)
    n = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    out, positions, labels = list(tokens), sorted(cand[:n]), []
    for p in positions:
        labels.append(tokens[p])
        if rng.random() < 0.8:
            out[p] = mask_id
        elif rng.random() < 0.5:
            out[p] = rng.randint(0, vocab_size - 1)
    return out, positions, labels


def main() -> None:
    from transformers import BertTokenizerLegacy

    ap = argparse.ArgumentParser()
    ap.add_argument("corpus")
    ap.add_argument("tokenizer")
    ap.add_argument("out")
    ap.add_argument("--dupe-factor", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=128)
    args = ap.parse_args()
    tok = BertTokenizerLegacy(vocab_file=str(Path(args.tokenizer) / "vocab.txt"), do_lower_case=True)
    t0 = time.perf_counter()
    docs = read_documents(Path(args.corpus), tok)
    t1 = time.perf_counter()
    rng = random.Random(12345)
    cls, sep = tok.convert_tokens_to_ids(["[CLS]", "[SEP]"])
    specials = {cls, sep}
    instances = []
    for _ in range(args.dupe_factor):
        for i in range(len(docs)):
            for a, b, is_random in instances_from_document(docs, i, args.max_seq_len, 0.1, rng):
                tokens = [cls, *a, sep, *b, sep]
                instances.append((*mask(tokens, len(tok.vocab), specials, rng, mask_id=tok.mask_token_id),
                                  len(a) + 2, is_random))
    rng.shuffle(instances)
    with open(args.out, "wb") as f:
        pickle.dump(instances, f, protocol=pickle.HIGHEST_PROTOCOL)
    t2 = time.perf_counter()
    print(f"tokenize {t1 - t0:.1f}s instances {t2 - t1:.1f}s ({len(instances)} instances)", file=sys.stderr)


if __name__ == "__main__":
    main()
