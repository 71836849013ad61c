"""bertforge's fp32 products for CPUs without AVX-512 (kernels/fp32_panels.h: `f32_pack`, `f32_linear`) against
PyTorch's Linear, and the few-row products an fp32 `PackedLinear` takes to them where the AVX2 build runs (on an
AVX-512 CPU, tests/test_kernels.py's child process runs this file on the AVX2 build)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bertforge.infer import transforms
from bertforge.infer.transforms import PANEL_MAX_ROWS, PackedLinear

needs_kernels = pytest.mark.usefixtures("int8_kernels")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, gelu: bool) -> torch.Tensor:
    y = F.linear(x.double(), w.double(), b.double())
    return F.gelu(y) if gelu else y


@needs_kernels
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize(("M", "K", "N"), [(1, 384, 384), (7, 20, 16), (27, 384, 1152), (130, 600, 48),
                                           (13, 1536, 32)])
def test_the_fp32_kernel_gives_the_linear_layers_product(M, K, N, gelu):
    """Rows in 6-row tiles and shorter last ones, one row block or several, K in one pass or k-blocks (600: three of
    200), batched inputs (3, M, K); every output within fp32 rounding of the product in float64, and the same bits
    on one thread as on two."""
    torch.manual_seed(M + K)
    x, w, b = torch.randn(3, M, K), torch.randn(N, K) / K ** 0.5, torch.randn(N)
    panels = torch.ops.bertforge.f32_pack(w)
    assert panels.shape == (N // 16, K, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.bertforge.f32_linear(x, panels, b, gelu)
        torch.set_num_threads(2)
        two = torch.ops.bertforge.f32_linear(x, panels, b, gelu)
    finally:
        torch.set_num_threads(before)
    assert one.shape == (3, M, N) and one.dtype == torch.float32
    assert (one.double() - reference(x, w, b, gelu)).abs().max() < 2e-5
    assert torch.equal(one, two)


@needs_kernels
def test_the_fp32_kernel_refuses_operands_it_does_not_take():
    panels = torch.ops.bertforge.f32_pack(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.bertforge.f32_pack(torch.randn(20, 64))
    with pytest.raises(RuntimeError, match="panels must be f32_pack's"):
        torch.ops.bertforge.f32_linear(torch.randn(5, 63), panels, torch.zeros(32), False)
    with pytest.raises(RuntimeError, match="bias must be fp32 with a value a column"):
        torch.ops.bertforge.f32_linear(torch.randn(5, 64), panels, torch.zeros(16), False)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        torch.ops.bertforge.f32_linear(torch.randn(5, 64, dtype=torch.float64), panels, torch.zeros(32), False)
    with pytest.raises(RuntimeError, match="x must be fp32"):  # no inputs to multiply
        torch.ops.bertforge.f32_linear(torch.randn(5, 0), torch.ops.bertforge.f32_pack(torch.randn(16, 0)), None, False)


@needs_kernels
@pytest.mark.skipif(not transforms._has_onednn_ops(), reason="this torch lacks the oneDNN operators PackedLinear calls")
def test_packed_linears_take_few_rows_to_the_fp32_kernel_where_the_avx2_build_runs():
    """Up to PANEL_MAX_ROWS rows on the kernel's product, more on oneDNN's, both the layer's to rounding, the GELU
    where the layer applies it; no second copy of the weight where the kernel would not be used."""
    if not transforms.fp32_panels():
        pytest.skip("the AVX2 build runs this (on AVX-512 CPUs, tests/test_kernels.py's child process)")
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    packed = PackedLinear(lin, torch.float32)
    few = [torch.randn(1, 27, 64), torch.randn(1, PANEL_MAX_ROWS, 64)]  # a snippet's tokens; the most the kernel takes
    many = [torch.randn(1, PANEL_MAX_ROWS + 1, 64), torch.randn(2, 100, 64)]
    for gelu in (False, True):
        packed.activation = "gelu" if gelu else "none"
        for x in few:
            assert torch.equal(packed(x), torch.ops.bertforge.f32_linear(x, packed.panels, packed.bias, gelu))
        for x in many:
            onednn = torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, packed.activation, [],
                                                        "none" if gelu else "")
            assert torch.equal(packed(x), onednn)
        with torch.no_grad():
            for x in few + many:
                assert torch.allclose(packed(x), F.gelu(lin(x)) if gelu else lin(x), atol=2e-5, rtol=0)
    unbiased = PackedLinear(nn.Linear(64, 16, bias=False), torch.float32)
    x = few[0]
    assert torch.equal(unbiased(x), torch.ops.bertforge.f32_linear(x, unbiased.panels, torch.zeros(16), False))
    assert PackedLinear(nn.Linear(64, 2), torch.float32).panels is None  # not a multiple of 16 columns
    with transforms.on_onednn():
        assert PackedLinear(lin, torch.float32).panels is None
    assert transforms.fp32_panels()  # as it was after the comparison's side
