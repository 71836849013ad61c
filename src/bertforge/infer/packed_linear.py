"""fp32 and bf16 Linear layers for CPU inference (`PackedLinear`): each weight laid out once for oneDNN's matrix
kernels, a short text's few rows on bertforge's own fp32 product where that is the faster, a classifier's narrow head
on PyTorch's. `transforms.pack_linears` puts them in a model; why each, with its measurements: `bertforge.infer`."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from bertforge import kernels
from bertforge.gelu import gelu


class PackedLinear(nn.Module):
    """An nn.Linear for CPU inference: its weight reordered once, in fp32 or bf16, into the blocked layout of
    oneDNN's matrix kernels, which then read it as it is on every call. The product is nn.Linear's in the
    weight's dtype (fp32: the same to rounding, max |difference| ~1e-6 on unit-scale inputs).

    Where bertforge's kernels load (`fp32_panels`), an fp32 layer keeps a second copy of its weight, packed for the
    kernels' own fp32 product (fp32_panels.h), which takes its inputs of at most `PANEL_MAX_ROWS` rows (a short text
    or two), oneDNN the rest. There oneDNN's products run at well under their full-batch speed: on a 2-core Zen 1 EPYC
    (AVX2) MiniLM-L6 answered one Rotten Tomatoes snippet 1.21-1.47x sooner on the kernels', and on a 2-core Xeon
    (AVX-512, the kernels' 14 x 32 tiles) its products of 27 rows ran 1.18-1.39x oneDNN's, BERT-base's 1.08-1.29x
    (docs/benchmarks.md), while oneDNN ran the larger products up to 1.2x faster."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # a oneDNN tensor (layout torch._mkldnn), not a Parameter: state_dict and .to() do not apply to it
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(dtype))
        self.bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        self.dtype = dtype
        self.activation = "none"  # "gelu": the exact GELU applied as the product is written (`_fuse_gelu`)
        self.panel_rows = panel_rows(self.out_features) if dtype == torch.float32 else 0
        self.panels = torch.ops.bertforge.f32_pack(linear.weight.detach().float()) if self.panel_rows else None
        narrow = dtype == torch.float32 and self.out_features < 16
        self.narrow = linear.weight.detach().clone() if narrow else None

    def kernel_panels(self) -> torch.Tensor:
        """The weight packed for the kernels' fp32 product (fp32 layers, out_features a multiple of 16): the copy
        this layer keeps for its few-row products, else one packed now from its oneDNN weight."""
        if self.panels is not None:
            return self.panels
        return torch.ops.bertforge.f32_pack(self.weight.to_dense().float())

    def forward(self, x: torch.Tensor, bounds: torch.Tensor | None = None) -> torch.Tensor:
        """bounds: unused (`fused.FusedEncoder` hands it to every product)."""
        if self.panels is not None and x.numel() <= self.panel_rows * self.in_features:
            return torch.ops.bertforge.f32_linear(x, self.panels, self.bias, self.activation == "gelu")
        if self.narrow is not None and x.numel() * self.out_features <= NARROW_MAX_MACS:
            y = F.linear(x, self.narrow, self.bias)
            return gelu(y) if self.activation == "gelu" else y
        if self.activation == "gelu":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "gelu", [], "none")
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


# The most rows an fp32 `PackedLinear` multiplies on the kernels' fp32 products where it has them (`fp32_panels`).
# MiniLM-L6's four products on a 2-core Zen 1 EPYC, against oneDNN's, side by side: 27 rows 1.22-1.25x, 54 rows
# 1.10-1.12x, 128 rows 0.89x, 256 0.92x, 1,728 rows 0.89-0.95x; on a 2-core Xeon (AVX-512) MiniLM-L6's and BERT-base's
# at 64 rows 0.92-1.12x, at 128 0.81-1.10x.
PANEL_MAX_ROWS = 64

# The most multiply-adds an fp32 `PackedLinear` narrower than 16 outputs (a classifier's head) takes to PyTorch's
# product on its own copy of the weight rather than oneDNN's: oneDNN's fixed ~15 us a call is most of such a product's
# time. On a 2-core Zen 4 EPYC: 1 x 128 x 2 2.8 against 16.3 us, 64 x 384 x 3 9.7 against 21.9, 27 x 768 x 9 13.2
# against 20.9; from about 2M (1,728 x 128 x 9) on, oneDNN's was 1.7-2.7x faster.
NARROW_MAX_MACS = 1 << 18

FP32_PANELS = True  # False: fp32 `PackedLinear`s made from now on multiply on oneDNN alone (`fp32_on_onednn`)


@contextlib.contextmanager
def fp32_on_onednn():
    """fp32 `PackedLinear`s made inside take no products to bertforge's kernels (`transforms.on_onednn`)."""
    global FP32_PANELS
    saved, FP32_PANELS = FP32_PANELS, False
    try:
        yield
    finally:
        FP32_PANELS = saved


def fp32_panels() -> bool:
    """Do fp32 `PackedLinear`s take their few-row products to bertforge's fp32 kernels (fp32_panels.h)? Where the
    kernels load, unless `FP32_PANELS` is off (`panel_rows` says which products)."""
    return FP32_PANELS and kernels.available()


def panel_rows(out_features: int) -> int:
    """The most rows an fp32 `PackedLinear` of this shape multiplies on the kernels' fp32 product (0: none, and no
    second copy of its weight): `PANEL_MAX_ROWS` where its columns are whole panels of 16."""
    return PANEL_MAX_ROWS if out_features % 16 == 0 and fp32_panels() else 0
