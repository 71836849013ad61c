"""bertforge.add_norm: a post-LN layer's residual block, LayerNorm(residual + dropout(z + bias)), in one pass of the
kernels (kernels/add_norm.h) each way: outputs and every gradient against the block written out in float64 (dropout's
mask from the reference hash), the column sums' bits independent of the threads, a model's training step against the
unfused operators (in fp32, and under bf16 autocast, where the product is bf16), and which calls take it. Also run on
the AVX2 build (tests/test_kernels.py's ENGINE_TESTS)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import backward_nodes

import bertforge.add_norm as module
from bertforge import BertConfig, kernels
from bertforge.dropout import keep_mask_reference
from bertforge.models import BertForSequenceClassification, BertForTokenClassification

pytestmark = pytest.mark.usefixtures("int8_kernels")


def reference(z, bias, residual, weight, beta, p: float, key: int, eps: float = 1e-12) -> torch.Tensor:
    """The block in float64, dropout's kept values scaled by 1 / (1 - p)."""
    t = z.double() + bias.double()
    if p > 0:
        t = t * keep_mask_reference(t.numel(), p, key).view(t.shape) / (1 - p)
    return F.layer_norm(residual.double() + t, t.shape[-1:], weight.double(), beta.double(), eps)


def operands(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H = shape[-1]
    return [torch.randn(shape, generator=g), torch.randn(H, generator=g), torch.randn(shape, generator=g) * 2,
            1 + 0.1 * torch.randn(H, generator=g), 0.1 * torch.randn(H, generator=g)]


@pytest.mark.parametrize(("shape", "p"), [((5, 64), 0.0), ((3, 11, 48), 0.1), ((70, 32), 0.5), ((1, 16), 0.1)])
def test_the_block_and_its_gradients_match_float64(shape, p):
    key = 1234567890123
    z, bias, residual, weight, beta = operands(shape, 0)
    out, total, stats = torch.ops.bertforge.add_norm_train(z, bias, residual, weight, beta, 1e-12, p, key)
    leaves = [t.double().requires_grad_() for t in (z, bias, residual, weight, beta)]
    expected = reference(*leaves, p, key)
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=2e-5)
    assert stats.shape == (z.numel() // shape[-1], 2)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    expected.backward(grad.double())
    dsum, dz, dbias, dweight, dbeta = torch.ops.bertforge.add_norm_train_backward(grad, total, stats, weight, p, key,
                                                                                  torch.float32)
    rows = z.numel() // shape[-1]
    for got, want in ((dz, leaves[0].grad), (dbias, leaves[1].grad), (dsum, leaves[2].grad),
                      (dweight, leaves[3].grad), (dbeta, leaves[4].grad)):
        scale = float(want.abs().max())
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-5 * scale * rows**0.5)
    if p > 0:  # the dropped elements pass no gradient to z, and the residual's passes through them all
        dropped = ~keep_mask_reference(z.numel(), p, key).view(shape)
        assert (dz[dropped] == 0).all() and (dsum[dropped] != 0).any()


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_a_bf16_product_is_read_as_fp32_and_its_gradient_rounded_once(p):
    """Under bf16 autocast z is the product's bf16 output: the block is the float64 one of z's bf16 values, to fp32's
    precision, and z's gradient is the float64 one rounded to bf16 (within one bf16 rounding)."""
    key = 99
    z, bias, residual, weight, beta = operands((37, 96), 4)
    zb = z.bfloat16()
    out, total, stats = torch.ops.bertforge.add_norm_train(zb, bias, residual, weight, beta, 1e-12, p, key)
    assert out.dtype == total.dtype == torch.float32
    leaves = [t.double().requires_grad_() for t in (zb, bias, residual, weight, beta)]
    expected = reference(*leaves, p, key)
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=2e-5)
    grad = torch.randn(37, 96, generator=torch.Generator().manual_seed(3))
    expected.backward(grad.double())
    dsum, dz, dbias, *_ = torch.ops.bertforge.add_norm_train_backward(grad, total, stats, weight, p, key,
                                                                      torch.bfloat16)
    assert dz.dtype == torch.bfloat16 and dsum.dtype == dbias.dtype == torch.float32
    want = leaves[0].grad
    torch.testing.assert_close(dz.double(), want, rtol=2**-8, atol=1e-6 * float(want.abs().max()))
    torch.testing.assert_close(dsum.double(), leaves[2].grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dbias.double(), leaves[1].grad, rtol=1e-4, atol=1e-3)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.bertforge.add_norm_train_backward(grad, total, stats, weight, p, key, torch.float16)


def test_the_column_sums_are_the_same_bits_on_one_thread_and_on_two():
    z, bias, residual, weight, beta = operands((300, 64), 2)
    out, total, stats = torch.ops.bertforge.add_norm_train(z, bias, residual, weight, beta, 1e-12, 0.1, 7)
    grad, threads = torch.randn(300, 64), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.bertforge.add_norm_train_backward(grad, total, stats, weight, 0.1, 7, torch.float32)
        torch.set_num_threads(2)
        two = torch.ops.bertforge.add_norm_train_backward(grad, total, stats, weight, 0.1, 7, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_bad_operands_are_refused():
    z, bias, residual, weight, beta = operands((4, 32), 3)
    with pytest.raises(RuntimeError, match="one shape"):
        torch.ops.bertforge.add_norm_train(z, bias, residual[:3], weight, beta, 1e-12, 0.0, 0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.bertforge.add_norm_train(z[:, :20], bias[:20], residual[:, :20], weight[:20], beta[:20], 1e-12, 0.0,
                                           0)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.bertforge.add_norm_train(z, bias[:16], residual, weight, beta, 1e-12, 0.0, 0)
    with pytest.raises(RuntimeError, match="p must be"):
        torch.ops.bertforge.add_norm_train(z, bias, residual, weight, beta, 1e-12, 1.0, 0)


def config(layers: int = 3, **changes) -> BertConfig:
    return BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2,
                      intermediate_size=128, num_labels=3, **changes)


def train_once(model, batch: dict, fused: bool, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(module, "enabled", fused)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    out = model(**batch)
    out.loss.backward()
    return [out.logits.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("model_class", [BertForSequenceClassification, BertForTokenClassification])
def test_a_model_trains_as_with_the_unfused_operators(model_class, monkeypatch):
    """Dropout everywhere, a padded batch (the classifier's layers but the last on its real tokens, the tagger's all):
    the same logits and gradients up to fp32 rounding, the dropout masks the same."""
    torch.manual_seed(0)
    model = model_class(config()).train()
    mask = (torch.arange(13)[None, :] < torch.tensor([[13], [7], [11], [2]])).long()
    labels = torch.tensor([0, 1, 2, 1]) if model_class is BertForSequenceClassification else \
        torch.randint(0, 3, (4, 13)).masked_fill(mask == 0, -100)
    batch = {"input_ids": torch.randint(5, 100, (4, 13)), "attention_mask": mask, "labels": labels}
    fused, unfused = (train_once(model, batch, on, monkeypatch) for on in (True, False))
    for a, b in zip(fused, unfused, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def gradients(model, batch: dict, fused: bool, bf16: bool, monkeypatch) -> list[torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return [g.double() for g in train_once(model, batch, fused, monkeypatch)]


def test_under_bf16_autocast_a_model_trains_as_close_to_fp32_as_the_unfused_operators(monkeypatch):
    """The fused block rounds less than the unfused operators under bf16 autocast (the bias, dropout and their
    gradients in fp32, not bf16), so its logits and gradients are as near fp32 training's as theirs, or nearer."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(config(hidden_dropout_prob=0.0)).train()
    mask = (torch.arange(13)[None, :] < torch.tensor([[13], [7], [11], [2]])).long()
    batch = {"input_ids": torch.randint(5, 100, (4, 13)), "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 1])}
    exact = gradients(model, batch, False, False, monkeypatch)
    fused, unfused = (gradients(model, batch, on, True, monkeypatch) for on in (True, False))
    for f, u, e in zip(fused, unfused, exact, strict=True):
        error = float((f - e).norm() / e.norm())
        assert error < 0.05 and error <= 1.25 * float((u - e).norm() / e.norm()) + 1e-3


def norms_fused(model, batch: dict) -> int:
    return backward_nodes(model(**batch).loss).count("_AddNormBackward")


def test_training_takes_the_block_and_every_other_call_the_unfused_operators(monkeypatch):
    torch.manual_seed(0)
    model = BertForSequenceClassification(config(layers=2)).train()
    batch = {"input_ids": torch.randint(5, 100, (2, 9)), "labels": torch.tensor([0, 2])}
    assert norms_fused(model, batch) == 4  # two a layer
    assert norms_fused(BertForSequenceClassification(config(layers=2, pre_layer_norm=True)).train(), batch) == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norms_fused(model, batch) == 4
    with torch.autocast("cpu", dtype=torch.float16):
        assert norms_fused(model, batch) == 0
    for p in model.parameters():
        p.requires_grad_(False)
    layer, x = model.bert.encoder.layer[0], torch.randn(2, 9, 64)
    assert module.add_norm(layer.output, torch.randn(2, 9, 128), x, layer.output_norm, layer.dropout).grad_fn is None
    with monkeypatch.context() as patched:
        patched.setattr(kernels, "available", lambda: False)
        for p in model.parameters():
            p.requires_grad_(True)
        assert norms_fused(model, batch) == 0
    model.eval()
    with torch.no_grad():  # evaluation: torch's operators, bit for bit
        y = torch.randn(2, 9, 64)
        expected = layer.attention_norm(x + layer.attention_out(y))
        assert torch.equal(module.add_norm(layer.attention_out, y, x, layer.attention_norm, layer.dropout), expected)
