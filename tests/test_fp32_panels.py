"""bertforge's few-row fp32 products (kernels/fp32_panels.h: `f32_pack`, `f32_linear`) against PyTorch's Linear, and
the products an fp32 `PackedLinear` takes to them: any layer's few rows, in either build (on an AVX-512 CPU, the AVX2
build's bits are checked against the AVX-512 build's here, and tests/test_kernels.py's child process runs this file on
the AVX2 build too)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bertforge.cpu
from bertforge import kernels
from bertforge.infer import packed_linear, transforms
from bertforge.infer.packed_linear import NARROW_MAX_MACS, PANEL_MAX_ROWS, PackedLinear

needs_kernels = pytest.mark.usefixtures("int8_kernels")

# (rows, in, out): one panel of 16 columns, an odd number of them (48: three), many; rows from 1 to past two row tiles
SHAPES = [(1, 384, 384), (7, 20, 16), (27, 384, 1152), (130, 600, 48), (13, 1536, 32), (14, 64, 48), (15, 300, 16),
          (29, 128, 80)]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, gelu: bool) -> torch.Tensor:
    y = F.linear(x.double(), w.double(), b.double())
    return F.gelu(y) if gelu else y


@needs_kernels
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize(("M", "K", "N"), SHAPES)
def test_the_fp32_kernel_gives_the_linear_layers_product(M, K, N, gelu):
    """Rows in tiles of every height (the AVX2 build's 6 and shorter last ones; the AVX-512 build's up to 14 rows over
    one panel or two), one row block or several, K in one pass or k-blocks (600: three of 200), batched inputs (3, M,
    K); every output within fp32 rounding of the product in float64, and the same bits on one thread as on two."""
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


needs_onednn = pytest.mark.skipif(not transforms._has_onednn_ops(),
                                  reason="this torch lacks the oneDNN operators PackedLinear calls")


@needs_kernels
@needs_onednn
def test_packed_linears_take_few_rows_to_the_fp32_kernel():
    """Up to PANEL_MAX_ROWS rows of a small layer on the kernel's product, more on oneDNN's, both the layer's to
    rounding, the GELU where the layer applies it; no second copy of the weight where the kernel would not be used."""
    assert packed_linear.fp32_panels()
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    packed = PackedLinear(lin, torch.float32)
    assert packed.panel_rows == PANEL_MAX_ROWS
    few = [torch.randn(1, 27, 64), torch.randn(1, PANEL_MAX_ROWS, 64)]  # a snippet's tokens; the most the kernel takes
    many = [torch.randn(1, PANEL_MAX_ROWS + 1, 64), torch.randn(2, 100, 64)]
    for gelu in (False, True):
        packed.activation = "gelu" if gelu else "none"
        for x in few:
            assert torch.equal(packed(x), torch.ops.bertforge.f32_linear(x, packed.panels, packed.bias, gelu))
        for x in many:
            assert torch.equal(packed(x), on_onednn(packed, x))
        with torch.no_grad():
            for x in few + many:
                assert torch.allclose(packed(x), F.gelu(lin(x)) if gelu else lin(x), atol=2e-5, rtol=0)
    unbiased = PackedLinear(nn.Linear(64, 16, bias=False), torch.float32)
    x = few[0]
    assert torch.equal(unbiased(x), torch.ops.bertforge.f32_linear(x, unbiased.panels, torch.zeros(16), False))
    assert PackedLinear(nn.Linear(64, 2), torch.float32).panels is None  # not a multiple of 16 columns
    with transforms.on_onednn():
        assert PackedLinear(lin, torch.float32).panels is None
    assert packed_linear.fp32_panels()  # as it was after the comparison's side


def on_onednn(packed: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    gelu = packed.activation == "gelu"
    return torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, packed.activation, [],
                                              "none" if gelu else "")


@needs_kernels
@needs_onednn
def test_every_layer_takes_its_few_rows_to_the_fp32_kernel():
    """Large layers too (MiniLM-L6's feed-forward, BERT-base's), in either build: up to PANEL_MAX_ROWS rows on the
    kernel's product, more on oneDNN's."""
    torch.manual_seed(1)
    for lin in (nn.Linear(384, 1536), nn.Linear(768, 3072)):
        packed = PackedLinear(lin, torch.float32)
        assert packed.panel_rows == PANEL_MAX_ROWS
        inside, past = torch.randn(1, 27, lin.in_features), torch.randn(1, PANEL_MAX_ROWS + 1, lin.in_features)
        assert torch.equal(packed(inside), torch.ops.bertforge.f32_linear(inside, packed.panels, packed.bias, False))
        assert torch.equal(packed(past), on_onednn(packed, past))


AVX2_SIDE = """
import sys, torch
from bertforge import kernels
assert kernels.available() and kernels.isa() == "avx2"
operands = torch.load(sys.argv[1])
torch.save([torch.ops.bertforge.f32_linear(x, torch.ops.bertforge.f32_pack(w), b, gelu) for x, w, b, gelu in operands],
           sys.argv[2])
"""


@needs_kernels
def test_the_avx512_builds_wide_tiles_give_the_avx2_builds_bits(tmp_path):
    """Each output is the same sum in both builds (from the bias, k in order, one FMA each), whatever the tiles:
    the AVX2 build, forced in a child process, gives the same bits; after the GELU within an ulp or two (the builds'
    erf, vec.h, round differently in about a quarter of the outputs)."""
    if kernels.isa() == "avx2":
        pytest.skip("this process runs the AVX2 build: there is no second build here to compare it with")
    if not {"avx2", "fma"} <= bertforge.cpu.cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA to run the AVX2 build on")
    torch.manual_seed(3)
    operands = [(torch.randn(M, K), torch.randn(N, K) / K ** 0.5, torch.randn(N), gelu)
                for M, K, N in SHAPES for gelu in (False, True)]
    torch.save(operands, tmp_path / "operands.pt")
    child = subprocess.run([sys.executable, "-c", AVX2_SIDE, str(tmp_path / "operands.pt"), str(tmp_path / "y.pt")],
                           cwd=Path(__file__).parents[1], env={**os.environ, "BERTFORGE_KERNELS": "avx2"},
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    theirs = torch.load(tmp_path / "y.pt", weights_only=True)
    for (x, w, b, gelu), y in zip(operands, theirs, strict=True):
        ours = torch.ops.bertforge.f32_linear(x, torch.ops.bertforge.f32_pack(w), b, gelu)
        if gelu:
            assert torch.allclose(ours, y, rtol=0, atol=5e-7), (x.shape, w.shape)
        else:
            assert torch.equal(ours, y), (x.shape, w.shape)


@needs_onednn
def test_narrow_layers_multiply_few_rows_on_pytorchs_product():
    """A classifier's head (fewer than 16 outputs) over a text or a few: PyTorch's product on the layer's own weight
    (oneDNN's fixed cost is most of such a product's time); over many rows oneDNN's; both the layer's to rounding."""
    torch.manual_seed(2)
    head = nn.Linear(128, 3)
    packed = PackedLinear(head, torch.float32)
    few, many = torch.randn(4, 128), torch.randn(NARROW_MAX_MACS // (128 * 3) + 1, 128)
    assert torch.equal(packed(few), F.linear(few, head.weight, head.bias))
    assert torch.equal(packed(many), on_onednn(packed, many))
    with torch.no_grad():
        assert torch.allclose(packed(many), head(many), atol=2e-5, rtol=0)
    packed.activation = "gelu"
    assert torch.equal(packed(few), F.gelu(F.linear(few, head.weight, head.bias)))
    assert PackedLinear(nn.Linear(128, 16), torch.float32).narrow is None
    assert PackedLinear(head.to(torch.bfloat16), torch.bfloat16).narrow is None
