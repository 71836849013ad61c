"""Word embeddings from co-occurrence statistics (`pretrain --embedding-init cooccurrence`): the counts and PPMI
on cases computed here, embeddings that put words used alike together, the rows a model keeps, and a run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from safetensors.torch import load_file

from bertforge.cli import main
from bertforge.errors import BertforgeError
from bertforge.pretrain.cooccurrence import (
    SCALE,
    cooccurrence_embeddings,
    count_pairs,
    ppmi,
    set_word_embeddings,
    shard_streams,
)


def test_pairs_are_counted_by_distance_both_ways_and_not_across_documents():
    # two documents: [5 6 7 5] and [8 6]; window 2
    tokens, starts = np.array([5, 6, 7, 5, 8, 6]), np.array([0, 4])
    got = count_pairs([(tokens, starts)], 10, window=2).toarray()
    want = np.zeros((10, 10))
    for a, b, w in ((5, 6, 1), (6, 7, 1), (7, 5, 1), (5, 7, 0.5), (6, 5, 0.5), (8, 6, 1)):
        want[a, b] += w
        want[b, a] += w
    np.testing.assert_allclose(got, want)
    assert got[5, 8] == 0 and got[7, 8] == 0  # 5 and 7 end the first document, 8 starts the second


def test_counting_stops_after_max_tokens_and_reads_streams_in_order():
    first, second = (np.array([1, 2, 3]), np.array([0])), (np.array([4, 5]), np.array([0]))
    whole = count_pairs([first, second], 6, window=1).toarray()
    assert whole[4, 5] == 1 and whole[1, 2] == 1
    cut = count_pairs([first, second], 6, window=1, max_tokens=4).toarray()
    assert cut[4, 5] == 0 and cut[2, 3] == 1  # the second stream's first token only: no pair in it


def test_ppmi_equals_one_computed_by_hand():
    counts = np.array([[0, 4, 1], [4, 0, 2], [1, 2, 0]], float)
    got = ppmi(sp.csr_matrix(counts), smoothing=0.5).toarray()
    rows = counts.sum(1)
    context = counts.sum(0) ** 0.5 / (counts.sum(0) ** 0.5).sum()
    for i in range(3):
        for j in range(3):
            expected = max(0.0, math.log(counts[i, j] / (rows[i] * context[j]))) if counts[i, j] else 0.0
            assert got[i, j] == pytest.approx(expected, rel=1e-9), (i, j)


def _two_topics(seed: int = 0, documents: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """Documents of words 10-19 around marker 5, or of words 20-29 around marker 6; words 30-39 never occur."""
    rng = np.random.default_rng(seed)
    tokens, starts = [], []
    for d in range(documents):
        starts.append(len(tokens))
        group = 10 if d % 2 else 20
        for _ in range(12):
            tokens += [5 if d % 2 else 6, int(rng.integers(group, group + 10))]
    return np.array(tokens), np.array(starts)


def test_words_used_alike_end_up_alike_at_the_initializer_spread():
    vectors = cooccurrence_embeddings([_two_topics()], 40, 4, std=0.02)
    assert vectors.shape == (40, 4) and vectors.dtype == np.float32
    seen = np.abs(vectors).sum(1) > 0
    assert seen[10:30].all() and not seen[30:].any() and not seen[:5].any()
    assert vectors[seen].std() == pytest.approx(0.02, rel=1e-4)
    unit = vectors[10:30] / np.linalg.norm(vectors[10:30], axis=1, keepdims=True)
    cos = unit @ unit.T
    within = np.concatenate([cos[:10, :10][~np.eye(10, dtype=bool)], cos[10:, 10:][~np.eye(10, dtype=bool)]])
    across = cos[:10, 10:].ravel()
    assert within.min() > across.max()


def test_a_vocabulary_no_larger_than_the_width_fills_its_rank_and_a_split_without_pairs_is_refused():
    small = cooccurrence_embeddings([_two_topics()], 40, 48, std=0.02)
    assert small.shape == (40, 48) and not small[:, 39:].any() and small[:, :39].any()
    with pytest.raises(BertforgeError, match="no word pairs"):
        cooccurrence_embeddings([(np.array([7, 8, 9]), np.array([0, 1, 2]))], 40, 4, std=0.02)


def test_only_words_that_occur_and_are_not_special_are_written():
    embedding = torch.nn.Embedding(6, 3)
    before = embedding.weight.detach().clone()
    vectors = np.zeros((6, 3), np.float32)
    vectors[[1, 2, 4]] = np.arange(9, dtype=np.float32).reshape(3, 3) + 1
    special = np.array([True, True, False, False, False, False])
    assert set_word_embeddings(embedding, vectors, special) == 2
    after = embedding.weight.detach()
    torch.testing.assert_close(after[[2, 4]], torch.from_numpy(vectors[[2, 4]]))
    torch.testing.assert_close(after[[0, 1, 3, 5]], before[[0, 1, 3, 5]])


# --- a run ------------------------------------------------------------------------------------------------------


def _run(data, out, config: str, init: str, *extra: str, steps: int = 1, lr: float = 1e-12) -> list[str]:
    return ["pretrain", "--data", str(data), "--model", config, "--out", str(out), "--steps", str(steps), "--lr",
            str(lr), "--warmup-steps", "0", "--batch-size", "4", "--eval-batches", "0", "--no-progress", "--precision",
            "fp32", "--embedding-init", init, *extra]


@pytest.mark.slow  # counts and factorizes a corpus, then pretrains
def test_a_run_starts_its_word_embeddings_from_the_cooccurrences_and_records_it(tmp_path, tiny_config_file, capsys):
    from support import prepared_dir

    from bertforge.data.loader import PretrainingData

    data = prepared_dir()
    train = PretrainingData(data, "train")
    vocab = train.tokenizer.vocab_size
    config = tiny_config_file(vocab_size=vocab)
    assert main(_run(data, tmp_path / "cooc", config, "cooccurrence")) == 0
    assert "word embeddings of" in capsys.readouterr().out
    assert main(_run(data, tmp_path / "random", config, "random")) == 0
    assert json.loads((tmp_path / "cooc" / "run_config.json").read_text())["embedding_init"] == "cooccurrence"
    cooc, rand = (load_file(tmp_path / d / "model.safetensors")["bert.embeddings.word_embeddings.weight"]
                  for d in ("cooc", "random"))
    # at SCALE times the config's initializer range (0.02)
    vectors = cooccurrence_embeddings(shard_streams(train.documents.shards), vocab, 32, std=SCALE * 0.02)
    written = (np.abs(vectors).sum(1) > 0) & ~train.is_special
    assert written.sum() > 50
    # one step at lr 1e-12 moves nothing visibly: the written rows are the co-occurrence vectors, the others the
    # random run's (the same seed draws the same initialisation)
    torch.testing.assert_close(cooc[written], torch.from_numpy(vectors[written]), atol=1e-6, rtol=0)
    torch.testing.assert_close(cooc[~written], rand[~written], atol=1e-6, rtol=0)
    assert (cooc[written] - rand[written]).abs().max() > 0.01


def test_with_init_it_is_refused_in_one_line(tmp_path, tiny_config_file, capsys):
    from support import prepared_dir

    args = _run(prepared_dir(), tmp_path / "run", tiny_config_file(), "cooccurrence", "--init", str(tmp_path))
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--init" in err and "--embedding-init" in err
    assert not (tmp_path / "run").exists()


def test_a_split_without_pairs_leaves_the_embeddings_random_and_says_so(capsys):
    from types import SimpleNamespace

    from bertforge.config import BertConfig
    from bertforge.pretrain.cooccurrence import init_from_cooccurrences

    config = BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                        intermediate_size=16, max_position_embeddings=16)
    embedding = torch.nn.Embedding(40, 8)
    before = embedding.weight.detach().clone()
    one_token_documents = SimpleNamespace(_tokens=np.array([7, 8, 9]), document_offsets=lambda: np.array([0, 1, 2, 3]))
    train = SimpleNamespace(documents=SimpleNamespace(shards=[one_token_documents]), is_special=np.zeros(40, bool))
    init_from_cooccurrences(embedding, train, config)
    assert "the word embeddings stay random" in capsys.readouterr().out
    assert torch.equal(embedding.weight, before)


@pytest.mark.slow
def test_resume_after_an_interruption_is_bitwise_equal(tmp_path, tiny_config_file):
    """With the option on (dropout too, so the random numbers must be restored), a run resumed from its step-3
    checkpoint ends where the uninterrupted one did: the vectors computed again on resume draw no random numbers
    and the checkpoint's weights replace them."""
    import shutil

    from support import prepared_dir

    from bertforge.data.loader import PretrainingData
    from bertforge.files import read_jsonl

    data = prepared_dir()
    config = tiny_config_file(vocab_size=PretrainingData(data, "train").tokenizer.vocab_size)
    whole = _run(data, tmp_path / "whole", config, "cooccurrence", "--save-every", "3", "--log-every", "1",
                 "--dropout", "0.1", steps=6, lr=1e-3)
    assert main(whole) == 0
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-3", cut / "checkpoints" / "step-3")
    shutil.copy(tmp_path / "whole" / "run_config.json", cut / "run_config.json")
    rows = [r for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if r["step"] <= 3]
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = [str(cut) if a == str(tmp_path / "whole") else a for a in whole]
    assert main([*again, "--resume"]) == 0
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_unknown_embedding_init_is_refused_before_anything_runs(tmp_path):
    from support import prepared_dir

    from bertforge.pretrain.recipe import recipe_config

    with pytest.raises(BertforgeError, match="unknown embedding_init 'svd'; choose random or cooccurrence"):
        recipe_config("bert", data=prepared_dir(), out=tmp_path / "run", model="tiny", steps=1, embedding_init="svd")
    assert not (tmp_path / "run").exists()
