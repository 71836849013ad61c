"""How far the word embeddings have collapsed toward one direction: the representation degeneration that tied
softmax decoders are known for (Gao et al. 2019), measured as issue 48 first found it on the demo's model.

For a word-embedding matrix E (V, H), with u_i the unit vector of row i (rows of zero norm, such as an initialised
[PAD], left out of the unit-vector figures):

- `emb_cos_A_B`: the mean cosine u_i . u_j over the distinct pairs of ids i != j in [A, B), for each band of `BANDS`
  the vocabulary reaches. A WordPiece vocabulary lists its pieces roughly in the order they were learned, commonest
  first, so higher bands hold rarer pieces. It is exact, not sampled, and costs O(n H): the sum over all ordered
  pairs, diagonal included, is |sum_i u_i|^2, and the diagonal adds n.
- `emb_mean_unit_norm`: the norm of the mean unit vector over the whole vocabulary, the common direction's share
  (0 when the directions cancel out, 1 when all rows point one way; about 1/sqrt(V) at random initialisation).
- `emb_norm_mean`: the mean norm of the rows (initialisation: about initializer_range * sqrt(H)).

Pretraining logs them with every evaluation (metrics.jsonl); the demo and bench/pays.py report them for the
pretrained model beside a random initialisation of the same shape.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from bertforge.errors import BertforgeError
from bertforge.model_files import read_weights

BANDS = ((1000, 2000), (4000, 5000), (7000, 8000))
WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"  # the end of the parameter's Hugging Face name
_TINY = 1e-12  # a row's norm below this counts as zero


def band_key(lo: int, hi: int) -> str:
    return f"emb_cos_{lo}_{hi}"


def _mean_pair_cosine(units: torch.Tensor) -> float:
    """Mean of u_i . u_j over i != j of the rows of `units` (each of norm 1)."""
    n = units.shape[0]
    total = units.sum(0)  # (H,)
    return float((total @ total - n) / (n * (n - 1)))


def isotropy(weight: torch.Tensor, bands: tuple[tuple[int, int], ...] = BANDS) -> dict[str, float]:
    """The figures of the module's docstring for a word-embedding matrix (V, H)."""
    if weight.dim() != 2:
        raise BertforgeError(f"a word-embedding matrix has two dimensions (vocabulary, hidden), not {weight.dim()}")
    w = weight.detach().to("cpu", torch.float64)
    norms = w.norm(dim=1)  # (V,)
    kept = norms > _TINY
    units = w / norms.clamp_min(_TINY).unsqueeze(1)  # (V, H); rows of zero norm are zero here
    results = {}
    for lo, hi in bands:
        band = units[lo:hi][kept[lo:hi]]
        if hi <= w.shape[0] and band.shape[0] > 1:
            results[band_key(lo, hi)] = _mean_pair_cosine(band)
    count = int(kept.sum())
    results["emb_mean_unit_norm"] = float(units[kept].sum(0).norm() / count) if count else math.nan
    results["emb_norm_mean"] = float(norms.mean())
    return results


def model_isotropy(model: nn.Module) -> dict[str, float]:
    """`isotropy` of a BERT model's (`model.bert`'s) word embeddings."""
    return isotropy(model.bert.embeddings.word_embeddings.weight)


def directory_isotropy(model_dir: str | Path) -> dict[str, float]:
    """`isotropy` of the word embeddings in a model directory's weights."""
    state = read_weights(model_dir)
    names = sorted(k for k in state if k.endswith(WORD_EMBEDDINGS))
    if not names:
        raise BertforgeError(f"{model_dir} has no {WORD_EMBEDDINGS}: not a BERT model directory")
    return isotropy(state[names[0]])


def initial_isotropy(vocab_size: int, hidden_size: int, initializer_range: float, seed: int = 0) -> dict[str, float]:
    """`isotropy` of a random initialisation as the models draw it, N(0, initializer_range), for comparison."""
    g = torch.Generator().manual_seed(seed)
    return isotropy(torch.randn(vocab_size, hidden_size, generator=g, dtype=torch.float64) * initializer_range)
