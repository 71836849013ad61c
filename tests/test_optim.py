"""bertforge's AdamW and LAMB (bertforge.train.optim): torch's optimizer arithmetic without the wrappers that import
torch._dynamo at a training process's start."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch

from bertforge import kernels
from bertforge.config import BertConfig
from bertforge.models import BertForSequenceClassification
from bertforge.train import optim
from bertforge.train.optim import _unwrapped, build_optimizer, build_scheduler, clipped_step, parameter_groups

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


def _trained(step, max_norm: float, *, lamb: bool = False, lr: float = 1e-3) -> dict[str, torch.Tensor]:
    """A tiny classifier's weights after 4 steps whose gradients `step(optimizer, parameters, max_norm)` clips
    before stepping, and under "norms" the 4 norms it returned; the same data, start and optimizer settings for
    every `step`."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**TINY))
    optimizer = build_optimizer(model, name="lamb" if lamb else "adamw", lr=lr)
    norms = []
    for _ in range(4):
        ids, labels = torch.randint(0, 60, (8, 12)), torch.randint(0, 3, (8,))
        torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels).backward()
        norms.append(float(step(optimizer, model.parameters(), max_norm)))
        optimizer.zero_grad(set_to_none=True)
    return {**{k: v.clone() for k, v in model.state_dict().items()}, "norms": torch.tensor(norms)}


def _torchs(optimizer, parameters, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    optimizer.step()
    return float(norm)


needs_kernels = pytest.mark.usefixtures("int8_kernels")


@needs_kernels
def test_the_gradients_norm_is_the_norm_of_every_element_taken_together():
    """grad_norm over tensors of many sizes (a block's tail, one element, an empty one): the float64 norm of all
    their elements within fp32 summation error, the same bits on one thread as on two, and 0 for no tensors."""
    torch.manual_seed(0)
    tensors = [torch.randn(30_011, 77), torch.randn(1), torch.zeros(0), torch.randn(4096) * 1e-3, torch.randn(5) * 50]
    exact = torch.cat([t.double().flatten() for t in tensors]).norm().item()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.bertforge.grad_norm(tensors, [None] * len(tensors))
        torch.set_num_threads(2)
        two = torch.ops.bertforge.grad_norm(tensors, [None] * len(tensors))
    finally:
        torch.set_num_threads(before)
    assert one == two
    assert abs(one - exact) <= 1e-6 * exact
    assert torch.ops.bertforge.grad_norm([], []) == 0.0
    with pytest.raises(RuntimeError, match="contiguous fp32 CPU tensors"):
        torch.ops.bertforge.grad_norm([torch.randn(4, 3).t()], [None])


@needs_kernels
@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_a_clipped_step_on_the_kernels_is_torchs_clipping_and_step(monkeypatch, max_norm):
    """Clipping on (0.05: every step's gradients are scaled down) the kernels' path ends within fp32 rounding of
    torch's clip_grad_norm_ + fused AdamW; clipping without effect (1e6) is torch's bit for bit (nothing scales).
    The kernels' path never calls clip_grad_norm_; the norms it returns are torch's within rounding."""
    theirs, unclipped = _trained(_torchs, max_norm), _trained(_torchs, 1e6)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **kw: pytest.fail("torch's path taken"))
    ours = _trained(clipped_step, max_norm)
    torch.testing.assert_close(ours.pop("norms"), theirs.pop("norms"), rtol=1e-5, atol=0)  # the norms it returns
    for name, p in theirs.items():
        if max_norm > 1e3:
            assert torch.equal(ours[name], p), name
        else:
            torch.testing.assert_close(ours[name], p, rtol=1e-5, atol=1e-6, msg=name)
    if max_norm < 1:  # the clipping did change the training: the comparison above means something
        assert max((ours[n] - unclipped[n]).abs().max().item() for n in ours if n != "norms") > 1e-4


@pytest.mark.parametrize("why", ["no kernels", "lamb", "not finite"])
def test_a_clipped_step_falls_back_to_torchs_clipping_bit_for_bit(monkeypatch, why):
    """Without the kernels, with an optimizer other than fused AdamW, or with a norm that is not finite, the
    gradients are clipped by torch's clip_grad_norm_ itself: the weights are its bit for bit."""
    if why == "no kernels":
        monkeypatch.setattr(kernels, "available", lambda: False)
    if why == "not finite":
        monkeypatch.setattr(torch.ops.bertforge, "grad_norm", lambda grads, rows: float("inf"), raising=False)
        monkeypatch.setattr(kernels, "available", lambda: True)
    calls = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ours = _trained(clipped_step, 0.05, lamb=why == "lamb")
    assert len(calls) == 4
    theirs = _trained(_torchs, 0.05, lamb=why == "lamb")
    for name, p in theirs.items():
        assert torch.equal(ours[name], p), name


def test_a_step_without_clipping_never_takes_a_norm(monkeypatch):
    """max_norm 0: the optimizer steps on the gradients as they are, no norm taken on either path."""
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **kw: pytest.fail("clipped"))
    monkeypatch.setattr(optim, "_kernel_norm", lambda *a: pytest.fail("a norm was taken"))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**TINY))
    optimizer = build_optimizer(model, lr=1e-3)
    model(input_ids=torch.randint(0, 60, (2, 5))).logits.sum().backward()
    before = copy.deepcopy(model.state_dict())
    assert clipped_step(optimizer, model.parameters(), 0) is None
    assert any(not torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert not hasattr(optimizer, "grad_scale")
