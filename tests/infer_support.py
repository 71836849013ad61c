"""What the inference tests share (test_infer*.py; the model directories themselves are conftest's `mlm_dir` and
`clf_dir`): a vocabulary of whole words, so every expected value is computed by hand one text at a time, and
the texts they run, and the u8 codes int8 gives activations worked out on their own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

WORDS = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "that", "film", "movie", "good", "bad", "great",
         "awful", "plot", "acting", "story", "quick", "brown", "fox", "dog", "jumps", "over", "lazy", "john",
         "smith", "paris", "lives", "works", "where", "does", "who", "what", ",", ".", "?", "!", "'s"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
TEXTS = ["the film was good .", "bad", "the quick brown fox jumps over the lazy dog , and the dog was lazy .",
         "john smith lives in paris", "", "what a great movie ! the acting , the plot , the story", "awful acting"]
MASKED = ["the [MASK] was good .", "[MASK]", "the quick [MASK] fox jumps over the [MASK] dog , and [MASK] .",
          "a [MASK] movie", "john [MASK] lives in paris and works in the [MASK] of the film"]


def save(model, tokenizer, path: Path, task: dict | None = None) -> Path:
    """A model directory as bertforge writes it: weights, config, vocabulary and (for a task model) task.json."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if task is not None:
        (path / "task.json").write_text(json.dumps(task))
    return path


def unpadded_states(model, tokenizer, text: str) -> torch.Tensor:
    ids = torch.tensor([tokenizer.encode(text).ids])
    with torch.no_grad():
        return model(ids).sequence_output[0]  # (T, H), no mask, no padding


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine of each row of `a` with the same row of `b`."""
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def activation_codes(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """The u8 codes (float64), scale and zero point Int8Linear gives activations `x`, worked out here on their own:
    per tensor, the range [min(x, 0), max(x, 0)] in 255 steps, each value rounded to its nearest step, the zero
    point added, within [0, 255]."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / 255 or 1.0  # all zeros: any scale
    zero = round(-lo / scale)
    return (torch.round(x.double() / scale) + zero).clamp(0, 255), scale, zero


def row_codes(x: torch.Tensor, bits: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `bits`-bit codes (float64) of each row of `x` (in, last), with each row's scale and zero point (columns),
    as the u7 kernels (7 bits) and the VNNI kernels (8) quantize activations, worked out here on their own: per row,
    [min(row, 0), max(row, 0)] in 2^bits - 1 steps, rounded to the nearest, the zero point added, within
    [0, 2^bits - 1]."""
    top = 2 ** bits - 1
    x = x.double().reshape(-1, x.shape[-1])
    lo, hi = x.amin(1, keepdim=True).clamp(max=0), x.amax(1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / top
    scale[scale == 0] = 1.0
    zero = torch.round(-lo / scale)
    return (torch.round(x / scale) + zero).clamp(0, top), scale, zero


def padded_batch(T: int = 23, B: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (vocabulary 200) and a mask of keys then padding, sequences of T, 3, 11, T - 1, 7, 1, T and 2."""
    torch.manual_seed(1)
    ids = torch.randint(5, 200, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    for row, length in enumerate([T, 3, 11, T - 1, 7, 1, T, 2][:B]):
        mask[row, length:] = 0
    return ids, mask


def at_threads(counts, outputs) -> dict:
    """{n: outputs()} with torch on n threads for each n of counts (no gradients), its threads restored after."""
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            with torch.no_grad():
                got[n] = outputs()
    finally:
        torch.set_num_threads(threads)
    return got
