"""bertforge.gelu: the exact GELU and its gradient on the kernels (kernels/gelu.h) against torch's in float64, bf16
as the fp32 values rounded once, and which calls take the kernels (fp32 and bf16 CPU training) and which keep
torch's; the GELU with the bias of the product before it (`linear_gelu`) against float64 and the unfused layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import backward_nodes

from bertforge import kernels
from bertforge.config import BertConfig
from bertforge.encoder import activation
from bertforge.gelu import gelu
from bertforge.models import BertForSequenceClassification

# every kind of value a GELU input holds, and element counts that end mid-vector on either build (8 or 16 lanes)
SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1e-4, -1e-4, 0.5, -0.5, -0.7517916, 1.0, -1.0, 3.0, -3.0, 5.5, -5.5, 9.0, -9.0,
           20.0, -20.0, 80.0, -80.0]


def _inputs(n: int) -> torch.Tensor:
    torch.manual_seed(n)
    x = torch.cat([torch.tensor(SPECIAL), torch.randn(n) * 3, torch.linspace(-12, 12, n)])
    return x[: max(n, 1)] if n < len(SPECIAL) else x


@pytest.mark.parametrize("n", [1, 7, 15, 17, 1000, 70_001])
def test_the_kernels_gelu_and_its_gradient_match_torchs_in_float64(int8_kernels, n):
    x = _inputs(n)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    y = torch.ops.bertforge.gelu(x)
    dx = torch.ops.bertforge.gelu_backward(dy, x)
    y64 = F.gelu(x.double())
    dx64 = torch.ops.aten.gelu_backward(dy.double(), x.double())
    # erf within 1.5e-7 (Abramowitz and Stegun 7.1.26) moves y by |x| times half of it, plus fp32 rounding
    bound = 2e-7 + 1.5e-7 * x.double().abs()
    assert ((y.double() - y64).abs() <= bound + 1.2e-7 * y64.abs()).all()
    assert ((dx.double() - dx64).abs() <= (bound + 1.2e-7) * dy.double().abs() + 2e-7 * dx64.abs()).all()
    assert y.shape == x.shape and dx.dtype == torch.float32


def test_the_kernels_take_any_shape_and_a_non_contiguous_input(int8_kernels):
    x = torch.randn(6, 40, 24).transpose(1, 2)
    dy = torch.randn(6, 24, 40)
    torch.testing.assert_close(torch.ops.bertforge.gelu(x), F.gelu(x), rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(torch.ops.bertforge.gelu_backward(dy, x), torch.ops.aten.gelu_backward(dy, x),
                               rtol=1e-6, atol=2e-6)
    with pytest.raises(RuntimeError, match="gradient's shape"):
        torch.ops.bertforge.gelu_backward(torch.randn(3), torch.randn(4))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.bertforge.gelu(torch.randn(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="both of one type"):
        torch.ops.bertforge.gelu_backward(torch.randn(4).bfloat16(), torch.randn(4))


@pytest.mark.parametrize("n", [5, 16, 1000, 70_001])
def test_bf16_is_the_fp32_result_rounded_to_nearest_even(int8_kernels, n):
    x = torch.cat([torch.tensor([float("nan"), 3e38, -3e38, 0.0, -0.0]), _inputs(n) * 1.7])[:n].bfloat16()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    y, dx = torch.ops.bertforge.gelu(x), torch.ops.bertforge.gelu_backward(dy, x)
    assert y.dtype == dx.dtype == torch.bfloat16
    for got, fp32 in ((y, torch.ops.bertforge.gelu(x.float())),
                      (dx, torch.ops.bertforge.gelu_backward(dy.float(), x.float()))):
        nan = fp32.isnan()
        assert torch.equal(got.isnan(), nan)  # a NaN's bits are not compared: torch's casts keep its payload
        assert torch.equal(got[~nan].view(torch.int16), fp32[~nan].bfloat16().view(torch.int16))


def test_training_calls_take_the_kernels_and_every_other_call_torchs(int8_kernels):
    x = torch.randn(5, 33, requires_grad=True)
    y = gelu(x)
    assert type(y.grad_fn).__name__ == "_GeluBackward"
    dy = torch.randn(5, 33)
    y.backward(dy)
    torch.testing.assert_close(x.grad, torch.ops.aten.gelu_backward(dy, x.detach()), rtol=1e-6, atol=2e-6)
    with torch.no_grad():
        assert torch.equal(gelu(x), F.gelu(x))  # evaluation and inference: torch's, bit for bit
    assert type(gelu(x.detach().bfloat16().requires_grad_()).grad_fn).__name__ == "_GeluBackward"
    assert type(gelu(x.detach().double().requires_grad_()).grad_fn).__name__ == "GeluBackward0"
    assert torch.equal(gelu(x.detach()), F.gelu(x.detach()))


def test_without_the_kernels_training_uses_torchs_gelu(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    x = torch.randn(4, 9, requires_grad=True)
    assert type(gelu(x).grad_fn).__name__ == "GeluBackward0"


def test_a_models_training_step_runs_its_gelus_on_the_kernels(int8_kernels):
    assert activation("gelu") is gelu
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config).train()
    loss = model(torch.randint(5, 50, (3, 10)), labels=torch.tensor([0, 1, 1])).loss
    # one a layer, the intermediate product's bias inside it (`linear_gelu`)
    assert backward_nodes(loss).count("_GeluBiasBackward") == 2


@pytest.mark.parametrize("rows", [1, 31, 32, 33, 97])
def test_the_gelu_with_its_bias_and_the_bias_gradient_match_float64(int8_kernels, rows):
    """gelu(x + bias) and its gradients (x's, and the bias's: the column sums) against torch's in float64; rows around
    the kernel's chunk of 32, whose partial sums it adds in order."""
    torch.manual_seed(rows)
    x, bias, dy = torch.randn(rows, 48) * 3, torch.randn(48), torch.randn(rows, 48)
    y = torch.ops.bertforge.gelu_bias(x, bias)
    dx, dbias = torch.ops.bertforge.gelu_bias_backward(dy, x, bias)
    h = x.double() + bias.double()
    dh = torch.ops.aten.gelu_backward(dy.double(), h)
    torch.testing.assert_close(y.double(), F.gelu(h), rtol=2e-6, atol=5e-7 * 12)
    torch.testing.assert_close(dx.double(), dh, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(dbias.double(), dh.sum(0), rtol=1e-5, atol=1e-5 * rows**0.5)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.bertforge.gelu_bias(x, torch.randn(47))
    with pytest.raises(RuntimeError, match="whole vectors"):
        torch.ops.bertforge.gelu_bias(torch.randn(3, 20), torch.randn(20))


def test_the_bias_gradient_is_the_same_bits_on_one_thread_and_on_two(int8_kernels):
    x, bias, dy = torch.randn(200, 64), torch.randn(64), torch.randn(200, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.bertforge.gelu_bias_backward(dy, x, bias)
        torch.set_num_threads(2)
        two = torch.ops.bertforge.gelu_bias_backward(dy, x, bias)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_a_layer_with_the_bias_in_its_gelu_trains_as_the_unfused_one(int8_kernels, monkeypatch):
    """`linear_gelu` against `act(layer(x))`: the same output and gradients up to fp32 rounding; torch's operators in
    evaluation and where it does not apply."""
    import bertforge.gelu as module
    from bertforge.linear import Linear

    torch.manual_seed(0)
    layer, x = Linear(32, 64), torch.randn(3, 7, 32, requires_grad=True)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(module, "fuses_bias", fused)
        layer.zero_grad()
        x.grad = None
        y = module.linear_gelu(layer, x, gelu)
        assert (type(y.grad_fn).__name__ == "_GeluBiasBackward") == fused
        y.backward(torch.ones_like(y))
        results.append([y.detach(), x.grad, layer.weight.grad, layer.bias.grad])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(module.linear_gelu(layer, x, gelu), F.gelu(layer(x)))
    assert type(module.linear_gelu(layer, x, F.relu).grad_fn).__name__ != "_GeluBiasBackward"
