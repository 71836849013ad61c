"""Reorganising the code must not move results: small fixed-step runs (tests/pinned_run.py) give bitwise the
weights they gave before the training paths were moved onto one configuration object (pinned at commit 9e06835).

fp32 arithmetic is made the same on every x86 CPU the suite runs on: one thread, MKL's reproducible code path
(MKL_CBWR=COMPATIBLE), ATen's portable kernels and oneDNN's AVX2 ones (every CPU this project has seen has AVX2;
without that setting an AVX-512 CPU rounds differently). A change that is meant to move results updates these
digests in the same commit and says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PINNED = {"bert": "ec8a8a15ce45bee1", "budget": "4bb548f6cc06748f", "budget-half-depth": "eb7f8ec38ea4c243",
          "electra": "cda019f9c57b9c9e", "electra-generator": "fcacfde57f5cb4e9", "finetune": "f701eb15ee238f4d"}

SAME_ON_EVERY_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2",
                     "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_fixed_step_runs_give_the_pinned_weights(tmp_path):
    script = Path(__file__).with_name("pinned_run.py")
    env = {**os.environ, **SAME_ON_EVERY_CPU}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == PINNED
