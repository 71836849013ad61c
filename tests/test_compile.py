"""`--compile` on CPU: a short tiny-model pretraining run compiles a bounded set of graphs (none per step; batches
with and without padding alternate) and ends where the eager run ends. The graph is compiled with dynamic shapes,
so other lengths and masked-position counts reuse it; this fixture's batches all have length 64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import pretrain_config

from bertforge.files import read_jsonl
from bertforge.options import DataOptions
from bertforge.pretrain.run import pretrain
from bertforge.train.loop import LoopOptions


def _losses(prepared: Path, config: str, out: Path, *, compile: bool) -> list[float]:
    loop = LoopOptions(steps=6, batch_size=4, lr=1e-3, warmup_steps=2, log_every=1, progress=False, seed=3,
                      compile=compile, precision="fp32")
    pretrain(pretrain_config(prepared, out, model=config, loop=loop, data_options=DataOptions(eval_batches=0)))
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]


@pytest.mark.slow  # torch.compile takes seconds
def test_compiled_pretraining_matches_eager_without_recompiling(prepared, tiny_config_file, tmp_path):
    from torch._dynamo.utils import counters  # here: 1.9 s to import, for the workers that run this file only
    # no dropout: compiled dropout draws other random numbers
    config = tiny_config_file(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch._dynamo.reset()
    counters.clear()
    eager = _losses(prepared, config, tmp_path / "eager", compile=False)
    assert not counters["stats"], "eager run compiled something"
    compiled = _losses(prepared, config, tmp_path / "compiled", compile=True)
    # one graph for batches with padding; at most one more for a batch without (the mask is then None)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert len(compiled) == len(eager) == 6
    assert max(abs(a - b) for a, b in zip(compiled, eager, strict=True)) < 1e-4, (compiled, eager)
