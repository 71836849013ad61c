"""bertforge's AdamW and LAMB (bertforge.train.optim): torch's optimizer arithmetic without the wrappers that import
torch._dynamo at a training process's start."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch

from bertforge.config import BertConfig
from bertforge.models import BertForSequenceClassification
from bertforge.train.optim import _unwrapped, build_optimizer, build_scheduler, parameter_groups

TINY = dict(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32, num_labels=3)


def _steps(model, optimizer, scheduler, batches) -> None:
    for ids, labels in batches:
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _batches(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 60, (4, 12), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


@pytest.mark.slow  # two models trained 7 steps each
def test_adamw_is_torchs_fused_adamw_bit_for_bit_through_a_state_dict_round_trip():
    torch.manual_seed(0)
    ours_model = BertForSequenceClassification(BertConfig(**TINY)).eval()  # no dropout: the same forward twice
    ref_model = copy.deepcopy(ours_model)
    ours = build_optimizer(ours_model, lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(parameter_groups(ref_model, 0.01, lr=1e-3), lr=1e-3, betas=(0.9, 0.999), eps=1e-6,
                            fused=True)
    assert type(ours) is not torch.optim.AdamW and isinstance(ours, torch.optim.AdamW)
    # torch's AdamW, once built, wraps its class's step once more (the profiler's hook): ours still reaches the
    # function under every wrapper
    assert torch.optim.AdamW.step.hooked and not hasattr(_unwrapped(torch.optim.AdamW.step), "__wrapped__")
    schedules = [build_scheduler(o, 2, 8) for o in (ours, ref)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()": the step is counted
        _steps(ours_model, ours, schedules[0], _batches(1, 4))
        _steps(ref_model, ref, schedules[1], _batches(1, 4))
        # saved and loaded into a new optimizer and schedule, as a resumed run does; then more steps on each side
        resumed = build_optimizer(ours_model, lr=1e-3, weight_decay=0.01)
        schedule = build_scheduler(resumed, 2, 8)
        resumed.load_state_dict(ours.state_dict())
        schedule.load_state_dict(schedules[0].state_dict())
        _steps(ours_model, resumed, schedule, _batches(2, 3))
        _steps(ref_model, ref, schedules[1], _batches(2, 3))
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert a.grad is None  # zero_grad set them to None, as torch's does
    state, ref_state = resumed.state_dict()["state"], ref.state_dict()["state"]
    assert state.keys() == ref_state.keys()
    for k in state:
        assert all(torch.equal(state[k][s], ref_state[k][s]) for s in ("step", "exp_avg", "exp_avg_sq")), k


def test_lamb_still_steps_and_round_trips_its_state():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**TINY))
    before = [p.detach().clone() for p in model.parameters()]
    lamb = build_optimizer(model, name="lamb", lr=1e-2)
    _steps(model, lamb, build_scheduler(lamb, 0, 4), _batches(3, 2))
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    again = build_optimizer(model, name="lamb", lr=1e-2)
    again.load_state_dict(lamb.state_dict())
    assert again.state_dict()["state"][0]["step"] == 2


@pytest.mark.slow  # a fresh interpreter
def test_a_training_process_never_imports_the_compiler():
    """Building, stepping, saving and loading our optimizers leaves torch._dynamo unimported (1.9 s of a process's
    start here); torch's own AdamW imports it on construction. One fresh process for both of ours."""
    script = f"""
import sys, torch
from bertforge.config import BertConfig
from bertforge.models import BertForSequenceClassification
from bertforge.train.optim import build_optimizer, build_scheduler
model = BertForSequenceClassification(BertConfig(**{TINY!r}))
for name in ("adamw", "lamb"):
    opt = build_optimizer(model, name=name)
    sched = build_scheduler(opt, 1, 3)
    model(input_ids=torch.ones(2, 5, dtype=torch.long)).logits.sum().backward()
    opt.step(); sched.step(); opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    print(name, "torch._dynamo" in sys.modules)
torch.optim.AdamW(model.parameters())
print("torch's", "torch._dynamo" in sys.modules)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:3] == ["adamw False", "lamb False", "torch's True"]
