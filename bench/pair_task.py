"""bench/finetune.py's second workload: a GLUE-sized sentence-pair task built from the State of the Union corpus, and
a BERT-base directory with random initial weights that both sides start from.

The task (`write_pair_task`): next-sentence coherence, MRPC-sized (3,700 train / 400 dev / 400 test pairs). Each
speech (`<corpus>/*.txt`, paragraphs separated by blank lines) is cut into sentences simply: a paragraph's
whitespace collapsed, then split after . ! or ? where a space and a capital letter follow; sentences under 5 words
are skipped. The speeches are shuffled (seeded) and split 80/10/10 into train/dev/test, so no speech is in two
splits. Each example is an anchor sentence (drawn without replacement among sentences whose next sentence also has 5
words or more) with, half the time (labels shuffled, 50/50), its next sentence in the same speech ("next"), else a
sentence drawn from another speech of the same split ("random"). Written as train.csv, dev.csv, test.csv with
columns text,text_pair,label, in the order drawn (so the first N training pairs are a random sample).

The model (`random_bert_base`): BERT-base (L=12, H=768, 12 heads, intermediate 3072, 512 positions, dropout 0.1) as
`transformers.BertModel` with its standard initialisation (normal, std 0.02) under a fixed seed, saved with
`save_pretrained` (config.json + model.safetensors) next to the MiniLM package's tokenizer files (its uncased
30,522-word vocab.txt, tokenizer.json, tokenizer_config.json, special_tokens_map.json): no BERT-base checkpoint is
available offline, so the weights are random and both sides tokenize identically.
"""

from __future__ import annotations

import csv
import random
import re
import shutil
from pathlib import Path

import torch

SIZES = {"train": 3700, "dev": 400, "test": 400}
LABELS = ("next", "random")
MIN_WORDS = 5
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_SENTENCE_END = re.compile(r"(?<=[.!?]) (?=[A-Z])")


def sentences(path: Path) -> list[str]:
    """The speech's sentences in order: per paragraph (blank-line separated), whitespace collapsed, split after
    . ! ? followed by a space and a capital."""
    out = []
    for paragraph in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
        text = " ".join(paragraph.split())
        if text:
            out += _SENTENCE_END.split(text)
    return out


def long_enough(sentence: str) -> bool:
    return len(sentence.split()) >= MIN_WORDS


def split_speeches(paths: list[Path], seed: int) -> dict[str, list[Path]]:
    """Speeches shuffled (seeded) and split 80/10/10: dev and test 10% each, train the rest."""
    paths = sorted(paths)
    random.Random(seed).shuffle(paths)
    n = max(1, round(0.1 * len(paths)))
    return {"dev": paths[:n], "test": paths[n:2 * n], "train": paths[2 * n:]}


def draw_pairs(speeches: list[list[str]], n: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """n (text, text_pair, label) examples, half "next" and half "random" (labels shuffled), from `speeches` (each a
    list of sentences); a random partner comes from another speech and differs from the anchor's next sentence."""
    anchors = [(s, i) for s, sents in enumerate(speeches) for i in range(len(sents) - 1)
               if long_enough(sents[i]) and long_enough(sents[i + 1])]
    pools = [[t for t in sents if long_enough(t)] for sents in speeches]
    others = [s for s, pool in enumerate(pools) if pool]
    if len(anchors) < n or len(others) < 2:
        raise SystemExit(f"the corpus gives {len(anchors)} anchor sentences in {len(others)} speeches for a split "
                         f"that needs {n} pairs: pass a larger corpus")
    labels = [LABELS[0]] * (n // 2) + [LABELS[1]] * (n - n // 2)
    rng.shuffle(labels)
    out = []
    for (s, i), label in zip(rng.sample(anchors, n), labels, strict=True):
        following = speeches[s][i + 1]
        partner = following
        while label == LABELS[1] and partner == following:
            partner = rng.choice(pools[rng.choice([o for o in others if o != s])])
        out.append((speeches[s][i], partner, label))
    return out


def write_pair_task(out: Path, corpus: Path, *, eval_pairs: int = SIZES["dev"], seed: int = 0) -> dict[str, int]:
    """Write the pair task's train/dev/test.csv (columns text,text_pair,label) into `out`; dev and test get
    `eval_pairs` pairs each. Returns the speeches per split."""
    paths = list(corpus.glob("*.txt"))
    if len(paths) < 3:
        raise SystemExit(f"{corpus} has {len(paths)} speeches (*.txt); the pair task needs the SOTU corpus directory")
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sizes = {"train": SIZES["train"], "dev": eval_pairs, "test": eval_pairs}
    split = split_speeches(paths, seed)
    for name, n in sizes.items():
        with open(out / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "text_pair", "label"])
            writer.writerows(draw_pairs([sentences(p) for p in split[name]], n, rng))
    return {name: len(paths) for name, paths in split.items()}


def random_bert_base(out: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """A BERT-base directory with random weights (seeded; the global RNG is left as it was) and the tokenizer files
    of `tokenizer_from`, loadable by transformers and bertforge alike."""
    import transformers

    with open(tokenizer_from / "vocab.txt", encoding="utf-8") as f:
        vocab_size = sum(1 for _ in f)  # one token a line
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=768, num_hidden_layers=12,
                                     num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.BertModel(config)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out
