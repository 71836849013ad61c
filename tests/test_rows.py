"""A task model's word embedding trained on the rows its batches look up (bertforge.train.rows, kernels/adamw_rows.h,
grad_norm's rows): the same training as dense gradients and torch's fused AdamW, to rounding."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bertforge.cpu
from bertforge import kernels
from bertforge.config import BertConfig
from bertforge.models import BertForPreTraining, BertForSequenceClassification
from bertforge.train import rows
from bertforge.train.optim import AdamW, build_optimizer, build_scheduler, clipped_step

pytestmark = pytest.mark.usefixtures("int8_kernels")


@pytest.fixture(autouse=True)
def small_embeddings_too(monkeypatch):
    """These tests' embeddings are small: trained on their looked-up rows all the same."""
    monkeypatch.setattr(rows, "MIN_ELEMENTS", 0)


TINY = dict(vocab_size=300, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
HYPER = [1e-2, 0.9, 0.999, 0.01, 1e-6]  # lr, beta1, beta2, weight decay, eps


def _batches(n: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches whose ids reach further into the vocabulary step by step (rows first looked up late), with padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(1, 40 + 30 * i, (4, 10), generator=g)
        ids[0, 7:] = 0  # [PAD]: its row is never looked up for a gradient
        out.append((ids, torch.randint(0, 3, (4,), generator=g)))
    return out


def _train(looked_up: bool, batches, *, model=None, resume: tuple | None = None, max_norm: float = 0.05):
    """A tiny classifier trained on `batches` with clipping (0.05: every step scaled) and a warmup, dense or on
    looked-up rows; `resume`: the optimizer's and the schedule's states to go on from."""
    if model is None:
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(**TINY))
    optimizer = build_optimizer(model, lr=1e-2, looked_up_rows=looked_up)
    scheduler = build_scheduler(optimizer, 2, 8)
    assert bool(optimizer._looked_up) == looked_up
    if resume is not None:
        optimizer.load_state_dict(resume[0])
        scheduler.load_state_dict(resume[1])
    norms = []
    for ids, labels in batches:
        mask = (ids != 0).long()
        torch.nn.functional.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels).backward()
        norms.append(float(clipped_step(optimizer, model.parameters(), max_norm)))
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    optimizer.scheduler = scheduler
    return model, optimizer, norms


def test_training_on_looked_up_rows_is_dense_training_to_rounding():
    """Six steps with clipping: the same first norm bit for bit (the same gradients, the norm read over the touched
    rows' blocks), then every weight and AdamW moment within fp32 rounding of torch's fused AdamW on dense gradients;
    the padding row and the rows no batch looked up only decayed; the gradient buffer zero after each step."""
    batches = _batches(6)
    dense, dense_opt, dense_norms = _train(False, batches)
    rows, rows_opt, rows_norms = _train(True, batches)
    assert rows_norms[0] == dense_norms[0]
    assert rows_norms == pytest.approx(dense_norms, rel=1e-5)
    for (name, a), b in zip(dense.named_parameters(), rows.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
    weight = rows.bert.embeddings.word_embeddings.weight
    state, reference = rows_opt.state[weight], dense_opt.state[dense.bert.embeddings.word_embeddings.weight]
    assert torch.allclose(state["exp_avg"], reference["exp_avg"], rtol=1e-4, atol=1e-9)
    assert torch.allclose(state["exp_avg_sq"], reference["exp_avg_sq"], rtol=1e-4, atol=1e-12)
    assert float(state["step"]) == float(reference["step"]) == 6.0
    seen = torch.unique(torch.cat([ids.flatten() for ids, _ in batches]))
    seen = seen[seen != 0]
    assert torch.equal(state["live"].nonzero().flatten(), seen)
    assert torch.count_nonzero(weight.grad) == 0 and weight.grad is rows_opt._looked_up[weight][0].buffer
    # the padding row and the never looked-up rows: decayed, as the dense step decays them, moments still zero
    untouched = torch.ones(TINY["vocab_size"], dtype=torch.bool)
    untouched[seen] = False
    assert torch.count_nonzero(state["exp_avg"][untouched]) == 0
    assert torch.allclose(weight[untouched], dense.bert.embeddings.word_embeddings.weight[untouched], rtol=1e-6)


def test_the_rows_marked_live_change_no_bit_where_moments_and_gradients_are_zero():
    """adamw_rows: a row outside `live` with zero moments and gradient gets the bits the whole update gives it; the
    live rows' update is AdamW's (checked against float64); the step's scale divides the gradients."""
    torch.manual_seed(0)
    p = torch.randn(50, 24)
    grad, m, v = torch.zeros(50, 24), torch.zeros(50, 24), torch.zeros(50, 24)
    some = torch.tensor([3, 4, 17, 49])
    grad[some], m[some], v[some] = torch.randn(4, 24), torch.randn(4, 24) * 0.1, torch.rand(4, 24) * 0.01
    live = torch.zeros(50, dtype=torch.bool)
    live[some] = True
    results = []
    for marked in (live, torch.ones(50, dtype=torch.bool)):
        q, mq, vq = p.clone(), m.clone(), v.clone()
        torch.ops.bertforge.adamw_rows(q, grad, mq, vq, marked, HYPER + [3.0], torch.tensor(2.0))
        results.append((q, mq, vq))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    lr, b1, b2, wd, eps = HYPER
    g = grad.double() / 2.0
    m64 = b1 * m.double() + (1 - b1) * g
    v64 = b2 * v.double() + (1 - b2) * g * g
    step = 3.0
    expected = p.double() * (1 - lr * wd) - lr / (1 - b1**step) * m64 / (v64.sqrt() / (1 - b2**step) ** 0.5 + eps)
    assert torch.allclose(results[0][0].double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.allclose(results[0][1].double(), m64, rtol=1e-6, atol=1e-7)


def test_the_norm_over_touched_rows_is_the_whole_norm_bit_for_bit():
    """grad_norm with rows: only the blocks holding them are read; the result is the whole tensor's norm's bits,
    rows at block edges, a width that does not divide the block, the last row, and beside an ordinary tensor."""
    torch.manual_seed(0)
    sparse = torch.zeros(3000, 77)
    rows = torch.tensor([0, 53, 54, 1000, 2999])  # 53 x 77 = 4081: row 53 straddles the first block's end
    sparse[rows] = torch.randn(5, 77)
    other = torch.randn(1234)
    whole = torch.ops.bertforge.grad_norm([other, sparse], [None, None])
    assert torch.ops.bertforge.grad_norm([other, sparse], [None, rows]) == whole
    assert torch.ops.bertforge.grad_norm([sparse], [torch.zeros(0, dtype=torch.long)]) == 0.0
    with pytest.raises(RuntimeError, match="outside its tensor"):
        torch.ops.bertforge.grad_norm([sparse], [torch.tensor([3000])])


def test_a_resumed_run_on_looked_up_rows_is_the_uninterrupted_one_bit_for_bit():
    """Three steps, the optimizer's and the schedule's states through a state_dict round trip (`live` cast to fp32
    by torch's load_state_dict, as a checkpoint's is; new parameter groups, whose learning rate the schedule moves),
    three more: the six-step run's weights exactly. An ordinary AdamW's state (no `live`) resumes too, the live rows
    derived from its moments."""
    batches = _batches(6)
    whole, _, _ = _train(True, batches)
    half, half_opt, _ = _train(True, batches[:3])
    states = copy.deepcopy((half_opt.state_dict(), half_opt.scheduler.state_dict()))
    half_opt.release_rows()
    resumed, _, _ = _train(True, batches[3:], model=half, resume=states)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    dense_half, dense_opt, _ = _train(False, batches[:3])
    states = (dense_opt.state_dict(), dense_opt.scheduler.state_dict())
    went_on, went_on_opt, _ = _train(True, batches[3:], model=dense_half, resume=states)
    weight = went_on.bert.embeddings.word_embeddings.weight
    seen = torch.unique(torch.cat([ids.flatten() for ids, _ in batches]))
    assert torch.equal(went_on_opt.state[weight]["live"].nonzero().flatten(), seen[seen != 0])


def test_looked_up_rows_only_where_they_apply(monkeypatch):
    """Not for a pretraining model (its tied decoder reads the whole matrix), nor without the kernels, nor for an
    embedding under MIN_ELEMENTS or frozen, nor when not asked; after training (`release_rows`) the embedding is an
    ordinary one again."""
    torch.manual_seed(0)
    pretraining = BertForPreTraining(BertConfig(**TINY))
    assert pretraining.looked_up_embeddings() == []
    assert not build_optimizer(pretraining, looked_up_rows=True)._looked_up
    classifier = BertForSequenceClassification(BertConfig(**TINY))
    assert not build_optimizer(classifier)._looked_up
    with monkeypatch.context() as m:
        m.setattr(kernels, "available", lambda: False)
        assert not build_optimizer(classifier, looked_up_rows=True)._looked_up
    with monkeypatch.context() as m:
        m.setattr(rows, "MIN_ELEMENTS", TINY["vocab_size"] * TINY["hidden_size"] + 1)
        assert not build_optimizer(classifier, looked_up_rows=True)._looked_up
    embedding = classifier.bert.embeddings.word_embeddings
    embedding.weight.requires_grad_(False)  # frozen: not the optimizer's to train
    assert not build_optimizer(classifier, looked_up_rows=True)._looked_up
    embedding.weight.requires_grad_(True)
    optimizer = build_optimizer(classifier, looked_up_rows=True)
    assert isinstance(optimizer, AdamW) and embedding.sparse and embedding.weight.grad is not None
    optimizer.release_rows()
    assert not embedding.sparse and embedding.weight.grad is None and not optimizer._looked_up


def test_gradients_accumulated_over_micro_batches_are_the_sum():
    """Two backward passes before a step (gradient accumulation): the buffer holds both batches' gradients, and the
    rows to zero and to read are both batches' touched rows."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**TINY))
    reference = copy.deepcopy(model)
    optimizer = build_optimizer(model, looked_up_rows=True)
    (a, la), (b, lb) = _batches(2, seed=9)
    for m in (model, reference):
        for ids, labels in ((a, la), (b, lb)):
            torch.nn.functional.cross_entropy(m(input_ids=ids).logits, labels).backward()
    weight = model.bert.embeddings.word_embeddings.weight
    assert torch.allclose(weight.grad, reference.bert.embeddings.word_embeddings.weight.grad, atol=1e-7)
    expected = torch.unique(torch.cat([a.flatten(), b.flatten()]))
    assert torch.equal(optimizer.touched_rows(weight), expected[expected != 0])


AVX2_SIDE = """
import sys, torch
from bertforge import kernels
assert kernels.available() and kernels.isa() == "avx2"
p, g, m, v, live, hyper = torch.load(sys.argv[1], weights_only=True)
torch.ops.bertforge.adamw_rows(p, g, m, v, live, hyper, None)
torch.save((p, m, v), sys.argv[2])
"""


def test_the_avx512_and_avx2_builds_update_alike(tmp_path):
    """The update's fused multiply-adds and IEEE operations give the same bits in both builds (the AVX2 one forced
    in a child process)."""
    if kernels.isa() == "avx2":
        pytest.skip("this process runs the AVX2 build: there is no second build here to compare it with")
    if not {"avx2", "fma"} <= bertforge.cpu.cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA to run the AVX2 build on")
    torch.manual_seed(4)
    p, g, m, v = torch.randn(40, 77), torch.randn(40, 77), torch.randn(40, 77) * 0.1, torch.rand(40, 77) * 0.01
    live = torch.rand(40) < 0.5
    operands = (p, g, m, v, live, HYPER + [7.0])
    torch.save(operands, tmp_path / "operands.pt")
    child = subprocess.run([sys.executable, "-c", AVX2_SIDE, str(tmp_path / "operands.pt"), str(tmp_path / "out.pt")],
                           cwd=Path(__file__).parents[1], env={**os.environ, "BERTFORGE_KERNELS": "avx2"},
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    torch.ops.bertforge.adamw_rows(p, g, m, v, live, HYPER + [7.0], None)
    for ours, theirs in zip((p, m, v), torch.load(tmp_path / "out.pt", weights_only=True), strict=True):
        assert torch.equal(ours, theirs)
