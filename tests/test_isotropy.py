"""The word embeddings' isotropy figures (train/isotropy.py) on matrices whose answers are known by hand, and
pretraining's metrics.jsonl carrying them at each evaluation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support import pretrain_config

from bertforge.files import read_jsonl
from bertforge.options import DataOptions, LoopOptions
from bertforge.pretrain.isotropy import band_key, directory_isotropy, initial_isotropy, isotropy
from bertforge.pretrain.run import pretrain


def test_identical_rows_have_cosine_one_and_a_mean_unit_vector_of_norm_one():
    weight = torch.tensor([[3.0, 4.0]]).repeat(10, 1)  # every row (3, 4): norm 5
    figures = isotropy(weight, bands=((0, 10),))
    assert figures == pytest.approx({band_key(0, 10): 1.0, "emb_mean_unit_norm": 1.0, "emb_norm_mean": 5.0})


def test_orthogonal_rows_have_cosine_zero():
    weight = 2 * torch.eye(6)  # six orthogonal rows of norm 2
    figures = isotropy(weight, bands=((0, 6),))
    # the mean of six orthonormal unit vectors: each coordinate 1/6, norm sqrt(6)/6
    assert figures == pytest.approx({band_key(0, 6): 0.0, "emb_mean_unit_norm": math.sqrt(6) / 6,
                                     "emb_norm_mean": 2.0}, abs=1e-12)


def test_a_hand_computed_band_and_the_bands_the_vocabulary_lacks():
    # rows 0-2: (1, 0), (0, 1), (1, 1); pair cosines 0, 1/sqrt(2), 1/sqrt(2): mean sqrt(2)/3
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]])
    figures = isotropy(weight, bands=((0, 3), (1, 4), (2, 6)))
    assert figures[band_key(0, 3)] == pytest.approx(math.sqrt(2) / 3)
    # rows 1-3: (0,1), (1,1), (-1,0); cosines 1/sqrt(2), 0, -1/sqrt(2): mean 0
    assert figures[band_key(1, 4)] == pytest.approx(0.0, abs=1e-12)
    assert band_key(2, 6) not in figures  # the vocabulary has 4 ids, not 6
    # unit vectors (1,0) (0,1) (.707,.707) (-1,0) sum to (.707, 1.707)
    assert figures["emb_mean_unit_norm"] == pytest.approx(math.hypot(0.5 ** 0.5, 1 + 0.5 ** 0.5) / 4)
    assert figures["emb_norm_mean"] == pytest.approx((3 + math.sqrt(2)) / 4)


def test_a_zero_row_is_left_out_of_the_directions_but_not_the_norms():
    weight = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])  # [PAD] as initialised: zero
    figures = isotropy(weight, bands=((0, 3),))
    assert figures == pytest.approx({band_key(0, 3): 1.0, "emb_mean_unit_norm": 1.0, "emb_norm_mean": 1.0})


def test_random_initialisation_is_isotropic():
    figures = initial_isotropy(8000, 128, 0.02)
    assert set(figures) == {band_key(lo, hi) for lo, hi in ((1000, 2000), (4000, 5000), (7000, 8000))} | {
        "emb_mean_unit_norm", "emb_norm_mean"}
    # independent directions in 128 dimensions: a pair's cosine has std 1/sqrt(128), a band's mean of ~500k
    # pairs far less; the mean of 8000 unit vectors has norm about 1/sqrt(8000) = 0.011
    assert all(abs(figures[band_key(lo, hi)]) < 0.01 for lo, hi in ((1000, 2000), (4000, 5000), (7000, 8000)))
    assert 0.005 < figures["emb_mean_unit_norm"] < 0.02
    assert figures["emb_norm_mean"] == pytest.approx(0.02 * math.sqrt(128), rel=0.02)


@pytest.mark.slow  # a short pretraining
def test_pretraining_logs_the_isotropy_at_each_evaluation(prepared, tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"vocab_size": 2000, "hidden_size": 32, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64}))
    loop = LoopOptions(steps=6, batch_size=8, lr=1e-3, warmup_steps=1, eval_every=3, progress=False, seed=3)
    pretrain(pretrain_config(prepared, out, model=str(config), loop=loop, data_options=DataOptions(eval_batches=1)))
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]
    assert train and not any("emb_norm_mean" in r for r in train)  # at evaluations, not every step
    # the last evaluation's figures are those of the saved model's embeddings
    saved = directory_isotropy(out)
    assert set(saved) == {band_key(1000, 2000), "emb_mean_unit_norm", "emb_norm_mean"}
    assert {k: evals[-1][k] for k in saved} == pytest.approx(saved, rel=1e-9)
    assert evals[0]["emb_norm_mean"] != evals[-1]["emb_norm_mean"]  # measured at each evaluation, not once
