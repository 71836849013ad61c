"""Word embeddings from the corpus's co-occurrence statistics, to start a pretraining from (`pretrain
--embedding-init cooccurrence`).

A masked-LM's first thousands of steps learn which words keep each other's company; a short budget spends much
of itself there. The same knowledge is in the corpus's co-occurrence counts, and a few seconds of linear algebra
read it out: counts of word pairs within `WINDOW` tokens of each other (weighted 1/distance, inside a document),
positive pointwise mutual information with the context distribution smoothed to the power 0.75, and a truncated
SVD whose left vectors scaled by the square roots of the singular values are the embeddings (Levy, Goldberg and
Dagan 2015, "Improving Distributional Similarity with Lessons Learned from Word Embeddings"). On the demo's IMDB
reviews (6.9M tokens, 8,000 words) the nearest words of "great" are wonderful, excellent, superb; of "boring"
dull, predictable, tedious. At the AVX2 CPU's 10 minutes, three pretrainings from vectors at 3x the initializer's
spread fine-tuned +3.4 over random weights on IMDB on average, against +1.9 at 1x, and alike on Rotten Tomatoes
(+1.3; docs/experiments/untuned-task.md).

They are scaled to `SCALE` times the model's initializer range (the spread its random embeddings start with) and
written into the word embedding matrix of a new model; words that never occur, and the special tokens, keep their
random vectors. The counting reads a fixed prefix of the training split (`MAX_TOKENS`), so every process and every
resume computes the same matrix.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import scipy.sparse as sp
import torch

from bertforge.errors import BertforgeError

WINDOW = 4  # tokens on each side
SMOOTHING = 0.75  # context distribution smoothing
SCALE = 3.0  # their spread over the initializer range (the figures above)
MAX_TOKENS = 20_000_000  # the training split's prefix that is counted (about 5 s a 7M tokens on 2 cores)


def count_pairs(streams: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int, *, window: int = WINDOW,
                max_tokens: int = MAX_TOKENS) -> sp.csr_matrix:
    """Symmetric (V, V) co-occurrence counts: each pair of tokens at most `window` apart in the same document adds
    1/distance to both of its cells. `streams` yields (tokens (N,), document starts (D,): offsets into tokens, the
    first 0); at most `max_tokens` tokens are read, in order."""
    total, left = None, max_tokens
    for tokens, starts in streams:
        tokens = np.asarray(tokens[:left], dtype=np.int64)
        left -= len(tokens)
        document = np.zeros(len(tokens), np.int64)
        document[starts[(starts > 0) & (starts < len(tokens))]] = 1
        document = np.cumsum(document)
        for distance in range(1, window + 1):
            same = document[:-distance] == document[distance:]
            keys = torch.from_numpy(tokens[:-distance][same] * vocab_size + tokens[distance:][same])
            cells, counts = (x.numpy() for x in torch.unique(keys, return_counts=True))  # a parallel sort
            part = sp.csr_matrix((counts / distance, (cells // vocab_size, cells % vocab_size)),
                                 shape=(vocab_size, vocab_size))
            total = part if total is None else total + part
        if left <= 0:
            break
    if total is None:
        return sp.csr_matrix((vocab_size, vocab_size))
    return (total + total.T).tocsr()


def ppmi(counts: sp.csr_matrix, smoothing: float = SMOOTHING) -> sp.csr_matrix:
    """Positive PMI: max(0, log(n(w, c) / (n(w) P(c)))) with P(c) proportional to n(c)^smoothing."""
    counts = counts.tocoo()
    rows = np.asarray(counts.sum(1)).ravel()
    contexts = np.asarray(counts.sum(0)).ravel() ** smoothing
    contexts /= contexts.sum()
    pmi = np.log(counts.data) - np.log(rows[counts.row]) - np.log(contexts[counts.col])
    keep = pmi > 0
    return sp.csr_matrix((pmi[keep], (counts.row[keep], counts.col[keep])), shape=counts.shape)


def svd_solver():
    """scikit-learn's randomized SVD, imported on first use: the import takes a second (scipy.stats with it), which
    every other pretraining process would pay at start. `pretrain` calls this before a budget's clock starts."""
    from sklearn.utils.extmath import randomized_svd

    return randomized_svd


def cooccurrence_embeddings(streams: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int, dim: int, *,
                            std: float, seed: int = 0, window: int = WINDOW,
                            max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """(vocab_size, dim) float32 embeddings from the streams' co-occurrences (`count_pairs`, `ppmi`, a rank-`dim`
    SVD), scaled to standard deviation `std` over the words that occur; rows of words that never occur are 0. A
    vocabulary no larger than `dim` leaves the columns past its rank 0. Refuses a split without related pairs."""
    counts = count_pairs(streams, vocab_size, window=window, max_tokens=max_tokens)
    matrix = ppmi(counts) if counts.nnz else counts
    if matrix.nnz == 0:
        raise BertforgeError("no word pairs in the training split occur together more often than chance")
    rank = min(dim, vocab_size - 1)
    u, s, _ = svd_solver()(matrix, rank, n_iter=5, random_state=seed)
    vectors = np.zeros((vocab_size, dim))
    vectors[:, :rank] = u * np.sqrt(s)
    seen = np.asarray(matrix.getnnz(1)) > 0
    vectors[~seen] = 0.0
    vectors *= std / vectors[seen].std()
    return vectors.astype(np.float32)


def shard_streams(shards: Iterable) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """(tokens, document starts) of each of a split's shards (data/shards.py's `Shard`), for `count_pairs`."""
    for shard in shards:
        yield shard._tokens, shard.document_offsets()[:-1]


def set_word_embeddings(embedding: torch.nn.Embedding, vectors: np.ndarray, is_special: np.ndarray) -> int:
    """Write `vectors` into the embedding matrix where a word occurred (a non-zero row) and is not special; the
    rest keep their values. Returns the number of rows written."""
    rows = torch.from_numpy((np.abs(vectors).sum(1) > 0) & ~is_special)
    with torch.no_grad():
        weight = embedding.weight
        weight[rows] = torch.from_numpy(vectors)[rows].to(weight.device, weight.dtype)
    return int(rows.sum())


def init_from_cooccurrences(embedding: torch.nn.Embedding, train, config, *, verbose: bool = True) -> None:
    """A new model's word embeddings from the training split's co-occurrences (`train`: the split's
    PretrainingData, `config`: the model's); where the split has none to read, they stay random, and it says so."""
    started = time.perf_counter()
    try:
        vectors = cooccurrence_embeddings(shard_streams(train.documents.shards), config.vocab_size,
                                          config.hidden_size, std=SCALE * config.initializer_range)
    except BertforgeError as e:
        if verbose:
            print(f"--embedding-init cooccurrence: {e}; the word embeddings stay random", flush=True)
        return
    written = set_word_embeddings(embedding, vectors, train.is_special)
    if verbose:
        print(f"word embeddings of {written:,} words from the training split's co-occurrences "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
