"""Packed training on CUDA (`bertforge.training_attention.VarlenAttention`): flash attention's variable-length form
over the batch's real tokens. On the CPU, a float64 reference stands in for torch's two flash operators (which
exist on CUDA only), checking what the autograd function hands them and what it makes of their results: each
sequence's rows attending among themselves, the gradient back in the query/key/value product's layout. On a GPU
(`pytest -m cuda`), the model trained packed against the padded batch, in bf16."""

from __future__ import annotations

import pytest
import torch
from support import gpu, right_padded

from bertforge import BertConfig, training_attention
from bertforge.models import BertForSequenceClassification, BertForTokenClassification
from bertforge.train.loop import autocast
from bertforge.training_attention import TrainingPacking, VarlenAttention


def per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v within each sequence's rows, float64; q, k, v (rows, N, D)."""
    out = []
    for a, b in zip(offsets, offsets[1:], strict=False):
        qs, ks, vs = (t[a:b].double().transpose(0, 1) for t in (q, k, v))  # (N, n, D)
        probs = (qs @ ks.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1)
        out.append((probs @ vs).transpose(0, 1))
    return torch.cat(out)


class StandIn:
    """The two flash operators' contract, computed by `per_sequence`: what flash needs of its inputs is asserted
    (last dimension contiguous, int32 offsets, the longest sequence), the calls recorded."""

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, args):
        cu_q, cu_k, max_q, max_k, p, causal = args
        assert all(t.stride(-1) == 1 and t.dim() == 3 for t in (q, k, v))
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k and not causal
        offsets = cu_q.tolist()
        assert max_q == max(b - a for a, b in zip(offsets, offsets[1:], strict=False))
        self.calls.append(("forward", offsets, p))
        out = per_sequence(q, k, v, offsets).to(q.dtype)
        lse, rng, unused = torch.zeros(q.shape[1], q.shape[0]), torch.zeros(2), torch.zeros(0)
        return out, lse, rng, unused, torch.zeros(0)

    def backward(self, grad, saved, args, rng):
        q, k, v, out, _ = saved
        assert grad.is_contiguous() and grad.shape == out.shape
        self.calls.append(("backward", args[0].tolist(), args[4]))
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():  # autograd runs a backward without it
            per_sequence(*leaves, args[0].tolist()).backward(grad.double())
        return tuple(t.grad.to(q.dtype) for t in leaves)


@pytest.fixture
def stand_in(monkeypatch) -> StandIn:
    s = StandIn()
    monkeypatch.setattr(training_attention, "flash_forward", s.forward)
    monkeypatch.setattr(training_attention, "flash_backward", s.backward)
    return s


def test_packed_rows_attend_within_their_sequence_and_the_gradient_returns_in_the_qkv_layout(stand_in):
    torch.manual_seed(0)
    heads, D, lengths, T = 3, 8, [7, 2, 5], 7
    packing = TrainingPacking.of(right_padded(lengths, T))
    assert packing.longest == 7 and packing.offsets.tolist() == [0, 7, 9, 14] and packing.device_offsets is None
    packing = TrainingPacking(packing.index, packing.offsets, packing.batch, packing.length, packing.longest,
                              packing.offsets.to(torch.int32))  # as `of` makes it on a CUDA device
    qkv = torch.randn(14, 3 * heads * D, requires_grad=True)
    out = VarlenAttention.apply(qkv, heads, packing, 0.1)
    grad = torch.randn_like(out)
    out.backward(grad)

    leaf = qkv.detach().double().requires_grad_()
    q, k, v = leaf.view(14, 3, heads, D).unbind(1)
    expected = per_sequence(q, k, v, [0, 7, 9, 14]).reshape(14, heads * D)
    expected.backward(grad.double())
    assert out.shape == (14, heads * D)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(qkv.grad.double(), leaf.grad, rtol=1e-5, atol=1e-6)
    assert stand_in.calls == [("forward", [0, 7, 9, 14], 0.1), ("backward", [0, 7, 9, 14], 0.1)]


def test_a_sequence_never_reads_another_sequences_rows(stand_in):
    """Changing the second sequence's rows leaves the first's outputs as they were."""
    heads, D = 2, 8
    packing = TrainingPacking.of(right_padded([4, 3], 4))
    packing = TrainingPacking(packing.index, packing.offsets, 2, 4, 4, packing.offsets.to(torch.int32))
    qkv = torch.randn(7, 3 * heads * D)
    first = VarlenAttention.apply(qkv, heads, packing, 0.0)
    qkv[4:] = torch.randn(3, 3 * heads * D)
    again = VarlenAttention.apply(qkv, heads, packing, 0.0)
    assert torch.equal(first[:4], again[:4]) and not torch.equal(first[4:], again[4:])


def test_packing_on_cuda_needs_cuda_and_a_half_precision_autocast():
    x = torch.randn(2, 5, 64)
    assert not VarlenAttention.applies(x, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not VarlenAttention.applies(x, 32)


# --- on a GPU ------------------------------------------------------------------------------------------------


def _train_once(model, batch: dict, packs: bool, seed: int, monkeypatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    monkeypatch.setattr(TrainingPacking, "enabled", packs)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with autocast(torch.device("cuda"), "bf16"):
        out = model(**batch)
    out.loss.backward()
    return out.logits.detach().float(), [p.grad.float() for p in model.parameters() if p.grad is not None]


def _close(a: torch.Tensor, b: torch.Tensor, share: float) -> bool:
    return float((a - b).norm()) <= share * float(b.norm()) + 1e-6


@gpu
@pytest.mark.parametrize("task", ["classifier", "tagger"])
def test_packed_training_on_the_gpu_matches_the_padded_batch(task, monkeypatch):
    """bf16 autocast, no dropout: the classifier's layers but the last on the real tokens (the tagger's all of them),
    through flash attention's variable-length form, against the padded batch through SDPA's masked kernel."""
    if not (torch.cuda.is_bf16_supported(including_emulation=False)
            and torch.cuda.get_device_capability() >= (8, 0)):
        pytest.skip(f"{torch.cuda.get_device_name()} runs no flash attention in bf16")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=200, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=256, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    mask = right_padded([40, 9, 33, 1, 27], 40)
    ids = torch.randint(5, 200, mask.shape)
    if task == "classifier":
        model, labels = BertForSequenceClassification(config), torch.tensor([0, 1, 2, 1, 0])
    else:
        model, labels = BertForTokenClassification(config), torch.randint(0, 3, mask.shape).masked_fill(~mask, -100)
    model = model.cuda().train()
    batch = {"input_ids": ids.cuda(), "attention_mask": mask.long().cuda(), "labels": labels.cuda()}
    calls, apply = [], VarlenAttention.apply
    monkeypatch.setattr(VarlenAttention, "apply", lambda *a: calls.append(a[0].shape[0]) or apply(*a))
    packed = _train_once(model, batch, True, 0, monkeypatch)
    assert calls and set(calls) == {110}  # the 110 real tokens of 200, in every packed layer
    padded = _train_once(model, batch, False, 0, monkeypatch)
    assert len(calls) == (2 if task == "classifier" else 3)
    # bf16 products on both sides, two attention kernels: their roundings (u = 2^-8) differ; a sequence reading
    # another's rows, or a lost row, moves the logits and gradients by their own scale
    rows = slice(None) if task == "classifier" else mask.cuda()
    assert _close(packed[0][rows], padded[0][rows], 0.03)
    for a, b in zip(packed[1], padded[1], strict=True):
        assert _close(a, b, 0.05)


@gpu
def test_packed_training_on_the_gpu_drops_attention_by_the_seed(monkeypatch):
    """Attention's dropout inside flash attention: the same seed gives the same gradients, another seed others."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip(f"{torch.cuda.get_device_name()} runs no flash attention")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=200, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.3)
    model = BertForSequenceClassification(config).cuda().train()
    mask = right_padded([30, 12, 25], 30)
    batch = {"input_ids": torch.randint(5, 200, mask.shape).cuda(), "attention_mask": mask.long().cuda(),
             "labels": torch.tensor([0, 1, 1]).cuda()}
    first, again, other = (_train_once(model, batch, True, seed, monkeypatch) for seed in (1, 1, 2))
    assert all(torch.equal(a, b) for a, b in zip(first[1], again[1], strict=True))
    assert not torch.equal(first[1][0], other[1][0])
