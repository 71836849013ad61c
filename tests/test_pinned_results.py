"""Reorganising the code must not move results: small fixed-step runs (tests/pinned_run.py) give bitwise the
weights they gave before the training paths were moved onto one configuration object (pinned at commit 9e06835).

fp32 arithmetic is made the same on every x86 CPU the suite runs on: one thread, MKL's reproducible code path
(MKL_CBWR=COMPATIBLE), ATen's portable kernels, oneDNN's AVX2 ones and OpenBLAS's Haswell ones (every CPU this
project has seen has AVX2; without these settings an AVX-512 CPU rounds differently, and OpenBLAS, which numpy and
scipy bring for the co-occurrence embeddings' SVD, picks its kernels by the CPU: SkylakeX ones on the Xeons, Haswell
ones on a Zen 5 EPYC, and their sums differ). The encoder's fp32 products stay on MKL (bertforge.linear moves them
to oneDNN on AMD CPUs with AVX-512; tests/test_linear.py checks that path against this one). A change that is meant
to move results updates these digests in the same commit and says why.

The budget recipe's two runs still round differently on one CPU family with all of this: the Zen 5 and Zen 4 EPYCs
give one pair of digests, the Xeons and a Zen 3 EPYC (AVX2 only) another. It is not OpenBLAS's kernels (the Zen 3
gives its pair with them pinned to Haswell, as the Zen 5 did) and not bertforge's kernels (before training's attention
ran on them, both parametrisations agreed on each CPU); the cause is not isolated yet. Both pairs are pinned, each
with the CPUs that gave it: a change that moves results gives a third pair and fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Moved twice on purpose. The runs with dropout (all but the budget recipe's):
# dropout's masks since come from a counter-based hash instead of torch's generator (bertforge.dropout; the same bits
# with or without the kernels). Then every run: the masked-LM head's rows and a sampled softmax's candidates are
# padded to fixed multiples (models.HEAD_ROWS_MULTIPLE), the padding left out of the loss, so the loss and its
# gradients are the same to rounding (tests/test_candidates.py) but the products' sums run in another order; the
# fine-tuning starts from the bert run.
PINNED = {"bert": "95978326e8678ad7", "electra": "16312b0bea01442d", "electra-generator": "c6147c49f8dd8bd5",
          "finetune": "ff96c35ce195c10e"}
# With bertforge's kernels training's attention runs on them (kernels/attention_train.h), whose sums round otherwise
# than the unfused path's: those runs have digests of their own, taken on the AVX2 build, forced so that every x86 CPU
# runs the same code (the AVX-512 build sums the softmax in 16 lanes, not 8). The budget recipe's runs are pinned
# without the kernels (its two pairs, below). Moved on purpose since: with the kernels, gradient clipping takes its
# norm in one pass of its own summing order (kernels/grad_norm.h) and hands the factor to fused AdamW, which divides
# each gradient by its inverse, where torch's clip_grad_norm_ multiplied (train/optim.py `clipped_step`). Then the
# runs whose heads read some positions of padded batches (bert, finetune): their layers but the last train on the real
# tokens alone (bertforge.training_attention.TrainingPacking), so their dropout draws its masks over those rows, not
# over the padded batch's. Then every run: training's GELU and its gradient run on the kernels (kernels/gelu.h: erf by
# Abramowitz and Stegun's 7.1.26, about 1e-6 from torch's values, IEEE operations only so every x86 CPU rounds alike).
# Then every run: a post-LN layer's residual blocks, LayerNorm(residual + dropout(z + bias)), run in one pass of the
# kernels each way (bertforge.add_norm; the same dropout masks, LayerNorm's sums in vectors, the bias added after the
# product, not before it), and the feed-forward's first bias is added inside its GELU (bertforge.gelu.linear_gelu).
PINNED_KERNELS = {"bert": "22f9945158d928af", "electra": "cbaa7bdab4572a64", "electra-generator": "efd8487b2db1c644",
                  "finetune": "bbfd86daa7f0e861"}
# The budget recipe's runs (the module's docstring says why there are two pairs).
PINNED_BUDGET = {"Zen 5, Zen 4 EPYCs": {"budget": "5857134b1b640cbd", "budget-half-depth": "e82660d509dbd9c0"},
                 "Xeons, Zen 3 EPYC": {"budget": "08daf67a19f195c0", "budget-half-depth": "47fbf6900cb7fb2f"}}

SAME_ON_EVERY_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2",
                     "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_CORETYPE": "Haswell",
                     "OPENBLAS_NUM_THREADS": "1", "BERTFORGE_FP32_PRODUCTS": "mkl"}


@pytest.mark.parametrize("kernels", ["avx2", "0"], ids=["kernels", "no-kernels"])
def test_fixed_step_runs_give_the_pinned_weights(tmp_path, kernels):
    """Without bertforge's CPU kernels (dropout's masks from torch's operators, attention unfused), and with their
    AVX2 build (the same masks; attention on the kernels): each its pinned weights."""
    script = Path(__file__).with_name("pinned_run.py")
    env = {**os.environ, **SAME_ON_EVERY_CPU, "BERTFORGE_KERNELS": kernels}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    digests = json.loads(done.stdout.strip().splitlines()[-1])
    budget = {name: digests.pop(name, None) for name in ("budget", "budget-half-depth")}
    if kernels == "0":
        assert digests == PINNED
        assert budget in PINNED_BUDGET.values(), f"budget runs moved: {budget}"
    else:
        assert digests == PINNED_KERNELS
