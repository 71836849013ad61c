"""Reorganising the code must not move results: small fixed-step runs (tests/pinned_run.py) give bitwise the
weights they gave before the training paths were moved onto one configuration object (pinned at commit 9e06835).

fp32 arithmetic is made the same on every x86 CPU the suite runs on: one thread, MKL's reproducible code path
(MKL_CBWR=COMPATIBLE), ATen's portable kernels, oneDNN's AVX2 ones and OpenBLAS's Haswell ones (every CPU this
project has seen has AVX2; without these settings an AVX-512 CPU rounds differently, and OpenBLAS, which numpy and
scipy bring for the co-occurrence embeddings' SVD, picks its kernels by the CPU: SkylakeX ones on the Xeons, Haswell
ones on a Zen 5 EPYC, and their sums differ). The encoder's fp32 products stay on MKL (bertforge.linear moves them
to oneDNN on AMD CPUs with AVX-512; tests/test_linear.py checks that path against this one). A change that is meant
to move results updates these digests in the same commit and says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Moved twice on purpose, and once by the setting below. The runs with dropout (all but the budget recipe's):
# dropout's masks since come from a counter-based hash instead of torch's generator (bertforge.dropout; the same bits
# with or without the kernels). Then every run: the masked-LM head's rows and a sampled softmax's candidates are
# padded to fixed multiples (models.HEAD_ROWS_MULTIPLE), the padding left out of the loss, so the loss and its
# gradients are the same to rounding (tests/test_candidates.py) but the products' sums run in another order; the
# fine-tuning starts from the bert run. Then the budget runs, when OpenBLAS was pinned to its Haswell kernels
# (SkylakeX ones had given 08daf67a19f195c0 and 47fbf6900cb7fb2f on the Xeons; Haswell ones give these on every CPU).
PINNED = {"bert": "95978326e8678ad7", "budget": "5857134b1b640cbd", "budget-half-depth": "e82660d509dbd9c0",
          "electra": "16312b0bea01442d", "electra-generator": "c6147c49f8dd8bd5", "finetune": "ff96c35ce195c10e"}

SAME_ON_EVERY_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2",
                     "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_CORETYPE": "Haswell",
                     "OPENBLAS_NUM_THREADS": "1", "BERTFORGE_FP32_PRODUCTS": "mkl"}


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["kernels", "no-kernels"])
def test_fixed_step_runs_give_the_pinned_weights(tmp_path, kernels):
    """With bertforge's CPU kernels and without them (dropout's masks from torch's operators): the same weights."""
    script = Path(__file__).with_name("pinned_run.py")
    env = {**os.environ, **SAME_ON_EVERY_CPU, "BERTFORGE_KERNELS": kernels}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == PINNED
