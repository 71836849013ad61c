"""A model rewritten for fast inference on the CPU, in place, same weights: every Linear layer's weight packed once
for oneDNN's matrix kernels (`pack_linears`), or made int8 (`quantize_int8`): oneDNN's int8 products, the
feed-forward GELU inside them, short texts' attention in bf16 where the CPU multiplies it natively, and on an
AVX-512 or AVX2 CPU bertforge's own kernels between the products (`fused.FusedEncoder`; in bf16 the attention,
`fused.KernelSelfAttention`). `prepare` picks among them
for an engine's options. Why each, with its measurements: `bertforge.infer`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

from bertforge import cpu, kernels
from bertforge.encoder import BertLayer, BertSelfAttention
from bertforge.gelu import gelu
from bertforge.infer.checks import inference_dtype
from bertforge.infer.fused import fuse_encoders, kernel_attention
from bertforge.infer.packed_linear import PackedLinear, fp32_on_onednn, fp32_panels
from bertforge.infer.packing import pack_sequences
from bertforge.linear import has_onednn_linear, packed_rows
from bertforge.options import EngineOptions


@functools.cache
def _has_onednn_ops() -> bool:
    """Has this torch the oneDNN operators `PackedLinear` and `Int8Linear` call (else plain nn.Linear)?"""
    return has_onednn_linear() and hasattr(torch.ops.onednn, "qlinear_pointwise")


class Int8Linear(nn.Module):
    """A dynamically quantized Linear on oneDNN's int8 kernels. The weight is int8, symmetric per output
    channel with `weight_bits` bits (8: codes within +-127; 7: within +-63), reordered once; activations are
    quantized per call to all 8 bits (u8, per tensor, the zero point placed by the batch's min and max, a
    range that always holds 0); the output is fp32. With VNNI the products are summed in int32; on AVX2 the
    kernel first sums pairs of u8 x s8 products in int16, which 7-bit weights keep from saturating
    (`bertforge.cpu.int8_weight_bits`). `activation="gelu"` applies the exact (erf) GELU inside the kernel.
    `bf16_max_positions`: the output is bf16 instead, for inputs (..., T, in) of at most this many positions T
    (0: never), for the attention's explicit bf16 kernel (`quantize_int8`). `kernels`: fp32 inputs' range and
    codes come from bertforge's kernels (`fused.FusedEncoder` sets it): the same codes up to a code off by one at a
    rounding boundary, faster (on 6,912 x 1,536, one thread: the range 1.3x torch.aminmax's speed, the codes 1.2x
    torch.quantize_per_tensor's). The product runs on the input's rows rounded up as a packed batch's are
    (`linear.packed_rows`; spare rows of code `zero`, their outputs dropped): oneDNN builds kernels for every new row
    count, and each batch of texts brings one (groups of 1-64 snippets, one group at a time: the demo's int8 BERT-tiny
    1.24-1.27x faster, MiniLM-L6 the same; docs/benchmarks.md).

    With 8-bit weights on a CPU with AVX-512 VNNI, where bertforge's kernels load, the product runs on them instead
    (`vnni`, packed once; the kernels' int8_vnni.h; `vnni_products`; with AMX only products of at most
    `AMX_VNNI_MAX_MACS` multiply-adds, a text or a few, the rest on oneDNN's AMX tiles): activations in 8 bits per row,
    each token by its own range, so that a text's result no longer depends on the batch it shares, and none of the
    per-call work around oneDNN's product (the range read back, the codes, the rounded row count). One text took half
    the time on a Zen 4 EPYC and on a Xeon with AMX (bench/inference.py --int8-onednn; MiniLM-L6 and BERT-tiny), a
    file as long (MiniLM-L6) or 1.12-1.26x less (BERT-tiny), and the int8 MiniLM-L6 kept fp32's label on 99.6% of
    texts instead of 98.5-98.6% (Zen 4; with AMX a batch's large products run on oneDNN, per tensor).

    With 7-bit weights (CPUs without int8 dot products) the product runs elsewhere, keeping a second int8 copy of
    the weight, one more byte a weight. Where bertforge's kernels load, on its u7 kernels (`u7`, packed once; the
    kernels' int8_u7.h): activations in 7 bits per row, each token by its own range, which lets four products sum in
    int16 (on a Zen 3 EPYC 1.13-1.24x oneDNN's speed at a full batch, 2.6-6.4x on one text; bench/int8_u7.py) and kept
    three fine-tuned classifiers within 0.45 points of fp32 (7 bits per tensor lost up to 2.25), a text's result no
    longer depending on the batch it shares. Where they do not, up to `FEW_ROWS` rows (a text or two) run on fbgemm's
    int8 kernels (`few_rows`, None where torch lacks fbgemm) on this class's own codes: oneDNN's AVX2 code ran so few
    rows at a third of its full-batch speed."""

    def __init__(self, linear: nn.Linear, weight_bits: int = 8):
        super().__init__()
        if weight_bits not in (7, 8):
            raise ValueError(f"weight_bits must be 7 or 8, not {weight_bits}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        top = 2 ** (weight_bits - 1) - 1
        self.weight_scale = w.abs().amax(1).clamp(min=1e-12) / top  # (out,)
        self.weight_zero = torch.zeros(self.out_features, dtype=torch.long)
        q = (w / self.weight_scale[:, None]).round().clamp(-top, top).to(torch.int8)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.activation = "none"
        self.bf16_max_positions = 0
        self.kernels = False
        # with int8 dot products: bertforge's VNNI kernels where they load, oneDNN's product elsewhere; with AMX both,
        # the VNNI kernels for products of at most AMX_VNNI_MAX_MACS multiply-adds (`vnni_max_rows` rows)
        self.vnni = torch.ops.bertforge.vnni_pack(q) if weight_bits == 8 and vnni_products() else None
        amx = self.vnni is not None and "amx_int8" in cpu.cpu_flags()
        self.vnni_max_rows = AMX_VNNI_MAX_MACS // (self.in_features * self.out_features) if amx else None
        self.weight = torch.ops.onednn.qlinear_prepack(q, None) if self.vnni is None or amx else None
        # without int8 dot products (7-bit weights): bertforge's u7 kernels where they load, else fbgemm's for few rows
        self.u7 = torch.ops.bertforge.u7_pack(q) if weight_bits == 7 and kernels.available() else None
        self.few_rows = _fbgemm_weight(q, self.weight_scale, self.bias) if weight_bits == 7 and not self.u7 else None

    def forward(self, x: torch.Tensor, bounds: torch.Tensor | None = None) -> torch.Tensor:
        """bounds: x's (min, max) where the caller already has them (the fused kernels give them)."""
        out = torch.bfloat16 if x.dim() > 2 and x.shape[-2] <= self.bf16_max_positions else torch.float32
        if self.vnni is not None and (self.vnni_max_rows is None or x.numel() <= self.vnni_max_rows * self.in_features):
            return torch.ops.bertforge.vnni_linear(x.float(), *self.vnni, self.weight_scale, self.bias,
                                                   self.out_features, self.activation == "gelu").to(out)
        if self.u7 is not None:
            return torch.ops.bertforge.u7_linear(x.float(), *self.u7, self.weight_scale, self.bias, self.out_features,
                                                 self.activation == "gelu").to(out)
        if self.few_rows is not None and x.numel() <= FEW_ROWS * self.in_features:
            y = torch.ops.quantized.linear_dynamic(x.float().reshape(-1, self.in_features), self.few_rows, False)
            y = F.gelu(y) if self.activation == "gelu" else y
            return y.view(*x.shape[:-1], self.out_features).to(out)
        if bounds is None:
            bounds = torch.ops.bertforge.value_range(x) if self.kernels else torch.aminmax(x)
        lo, hi = min(float(bounds[0]), 0.0), max(float(bounds[1]), 0.0)
        scale = (hi - lo) / 255 or 1.0
        zero = round(-lo / scale)
        codes = torch.ops.bertforge.quantize_u8(x, scale, zero) if self.kernels else _u8_codes(x.float(), scale, zero)
        count = codes.numel() // self.in_features
        rows = packed_rows(count)
        if rows > count:  # spare rows of code `zero`; a row count already rounded costs no extra operator
            codes = torch.cat([codes.reshape(count, -1), codes.new_full((rows - count, self.in_features), zero)])
        y = torch.ops.onednn.qlinear_pointwise(codes, scale, zero, self.weight, self.weight_scale, self.weight_zero,
                                               self.bias, 1.0, 0, out, self.activation, [], "none")
        return y if rows == count else y[:count].view(*x.shape[:-1], self.out_features)


def vnni_products() -> bool:
    """Do 8-bit `Int8Linear`s run on bertforge's VNNI kernels (int8_vnni.h)? Where they load in their AVX-512 build on
    an avx512_vnni CPU (with AMX the small products), unless `VNNI_PRODUCTS` is off (to measure oneDNN beside them)."""
    return VNNI_PRODUCTS and kernels.available() and torch.ops.bertforge.has_vnni()


# With AMX, oneDNN's int8 tiles run large products faster than the VNNI kernels and small ones slower: on a 2-core
# Xeon with AMX every product of at most 20 million multiply-adds ran faster on the VNNI kernels (1.05-4.2x), above
# that the faster side depended on the shape (BERT-tiny's and MiniLM-L6's at 32-1,920 rows: docs/benchmarks.md).
AMX_VNNI_MAX_MACS = 20_000_000

# The widest int8 encoder (its hidden size) run a sequence at a time (`fused.FusedEncoder.by_sequence`): each
# sequence reads every layer's weights, which stay in a core's cache up to about this width (512: 3.1 MB a layer;
# BERT-base's 7 MB come from memory again for every sequence). Encoders alone, 2-core Xeon with AMX (a sequence's
# products on AMX tiles, against oneDNN's over the batch; docs/benchmarks.md): at 64 x 28 tokens 128 wide 1.58-2.36x,
# 256 1.09-1.45x, 384 0.95-1.19x, 512 0.82-1.28x, BERT-base 0.51-0.61x; at 32 x 128 1.18-2.26x up to 512, BERT-base
# 1.01-1.21x. Without AMX (VNNI kernels both ways, AMX hidden from the check): 512 wide 1.18-1.34x at 28 tokens,
# BERT-base 0.74-0.77x.
SEQUENCE_MAX_HIDDEN = 512


VNNI_PRODUCTS = True  # False: `Int8Linear`s made from now on run on oneDNN even where the VNNI kernels would


@contextlib.contextmanager
def on_onednn():
    """Linear layers (and models) made inside run their products on oneDNN even where bertforge's kernels would:
    8-bit `Int8Linear`s without the VNNI kernels, fp32 `PackedLinear`s without the fp32 kernel's few-row products. The
    other side of a side-by-side run."""
    global VNNI_PRODUCTS
    saved, VNNI_PRODUCTS = VNNI_PRODUCTS, False
    try:
        with fp32_on_onednn():
            yield
    finally:
        VNNI_PRODUCTS = saved


# The most rows (tokens) an `Int8Linear` with 7-bit weights multiplies on fbgemm's kernels rather than oneDNN's. On a
# 2-core Zen 3 EPYC (AVX2, no VNNI), MiniLM-L6's 24 products with 7-bit weights and 8-bit activations, as `Int8Linear`
# quantizes them: fbgemm 2.5x oneDNN's speed on 16 rows, 2.0x on 32, 1.5x on 64, 1.2x on 128, even from 192 on.
FEW_ROWS = 128


def _fbgemm_weight(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """The weight's int8 codes (out, in) and per-channel scales packed for fbgemm's dynamic int8 product
    (`torch.ops.quantized.linear_dynamic`, activations quantized per call to all 8 bits, per tensor, by their
    min and max, as `Int8Linear` quantizes them: the same codes, the same sums), or None where this torch lacks
    fbgemm (the quantized tensors it takes are deprecated in favour of torchao)."""
    make = getattr(torch, "_make_per_channel_quantized_tensor", None)
    if "fbgemm" not in torch.backends.quantized.supported_engines or make is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weight = make(codes, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(weight, bias)


@functools.cache
def _one_pass_quantizer() -> bool:
    """Does torch have `quantize_per_tensor` (deprecated in favour of torchao, but in every torch bertforge
    supports)? Its one deprecation warning is taken here, once, so that predict does not print it."""
    if not hasattr(torch, "quantize_per_tensor"):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.quantize_per_tensor(torch.zeros(1), 1.0, 0, torch.quint8)
    return True


def _u8_codes(x: torch.Tensor, scale: float, zero: int) -> torch.Tensor:
    """round(x / scale) + zero within [0, 255], as uint8 (x fp32). torch's quantize_per_tensor does it in one
    vectorized pass, and its codes are read where it wrote them: `int_repr()` would copy them, which took 4x
    the quantizing itself. On the bench's MiniLM (AVX512-VNNI EPYC, 2 threads) int8 predict ran
    1.10-1.14x faster than with the three passes below, which remain for a torch without it."""
    if _one_pass_quantizer():
        q = torch.quantize_per_tensor(x, scale, zero, torch.quint8)
        return torch.empty(0, dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())
    # x / scale + zero rounded half up by the truncating cast, through int16 (torch casts float to uint8 one value
    # at a time, 3x slower than both casts); 0.5 code of headroom at the top, clamped
    shifted = torch.add(torch.tensor(zero + 0.5), x, alpha=1 / scale).clamp_(0, 255.5)
    return shifted.to(torch.int16).to(torch.uint8)


def _fp32_packed(product: nn.Module) -> bool:
    return isinstance(product, PackedLinear) and product.dtype == torch.float32


def _bf16_packed(product: nn.Module) -> bool:
    return isinstance(product, PackedLinear) and product.dtype == torch.bfloat16


def _fuse_gelu(model: nn.Module) -> None:
    """The feed-forward GELU of every BertLayer moved into its int8 or fp32 `intermediate` product (oneDNN applies
    it as the product is written, instead of a pass over the (B, T, I) output), where the layer's activation
    is the exact GELU: about 1.1x on the whole int8 model (bench/inference.py's MiniLM, 2 threads). In bf16 the GELU
    is then taken of the fp32 sum, where PyTorch's took it of the product's bf16 output (one rounding fewer)."""
    for layer in model.modules():
        if isinstance(layer, BertLayer) and layer.act is gelu and (
                isinstance(layer.intermediate, (Int8Linear, PackedLinear))):
            layer.intermediate.activation = "gelu"
            layer.act = nn.Identity()


# The longest sequences whose int8 attention runs in bf16 (`_bf16_attention`). Heads of 32, 4,096 tokens a call,
# one thread, AMD EPYC with AVX512-BF16: the explicit bf16 kernel took 4.7 against fp32's fused 6.1 ms at 16 keys,
# 7.0 against 9.8 at 40 and 8.9 against 9.0 at 64, but 11.3 against 11.1 at 80 and 17.0 against 15.1 at 128
# (`OMP_NUM_THREADS=1 bench/attention.py --int8 --heads 12 --head-size 32 --tokens 4096`). End to end, on 16-128-token
# texts, a threshold of 128 did no better than 64 (1.008x over fp32 attention both; bench/int8_attention.py).
INT8_BF16_ATTENTION_MAX_T = 64


def _bf16_attention(model: nn.Module) -> None:
    """On a CPU that multiplies bf16 natively, every int8 attention's query/key/value product written in bf16
    for sequences of up to `INT8_BF16_ATTENTION_MAX_T` positions: the attention then runs on the model's
    explicit bf16 kernel rather than fp32's fused one, whose cost on short sequences is mostly fixed per
    (sequence, head) pair. On fine-tuned MiniLM (AMD EPYC, one thread) the int8 model ran 1.05-1.08x faster over
    Rotten Tomatoes test and 1.01x over 16-128-token texts, accuracy within 0.1 points of the fp32 model's on dev
    and test (bench/int8_attention.py)."""
    if not cpu.has_native_bf16():
        return
    for attention in model.modules():
        if isinstance(attention, BertSelfAttention) and isinstance(attention.qkv, Int8Linear):
            attention.qkv.bf16_max_positions = INT8_BF16_ATTENTION_MAX_T


def _fuse_int8_encoders(model: nn.Module) -> None:
    """Every BertEncoder of int8 layers with the feed-forward GELU inside the product (`_fuse_gelu`) run on the
    kernels between its products (`fused.FusedEncoder`); where every product runs on the VNNI or the u7 kernels, a
    sequence at a time (`FusedEncoder.by_sequence`) up to `SEQUENCE_MAX_HIDDEN` wide. Their
    query/key/value products write fp32: the attention kernel takes bf16 too, 1.02-1.03x faster on the bench's
    MiniLM, but at 0.1-0.5 points of its Rotten Tomatoes dev accuracy in four measurements (fp32: +0.0 to +0.2;
    bench/int8_kernels.py)."""
    for encoder in fuse_encoders(model, lambda product: isinstance(product, Int8Linear)):
        products = encoder.products
        for layer in encoder.layer:
            layer.attention.qkv.bf16_max_positions = 0
        for product in products:
            product.kernels = True
        on_kernels = all(p.vnni is not None for p in products) or all(p.u7 is not None for p in products)
        if on_kernels and products[0].in_features <= SEQUENCE_MAX_HIDDEN:
            encoder.by_sequence()


def _fuse_fp32_encoders(model: nn.Module) -> None:
    """Every BertEncoder of fp32 `PackedLinear` layers with the feed-forward GELU inside the product run on the
    kernels between its products (`fused.FusedEncoder`); where the kernels' fp32 products run
    (`packed_linear.fp32_panels`), a sequence at a time (`FusedEncoder.by_sequence_fp32`): every batch up to
    `FP32_SEQUENCE_MAX_HIDDEN` wide, a text served alone if wider."""
    if not FUSE_FP32:
        return
    for encoder in fuse_encoders(model, _fp32_packed):
        products = encoder.products
        if fp32_panels() and all(p.out_features % 16 == 0 for p in products):
            encoder.by_sequence_fp32(lone_only=products[0].in_features > FP32_SEQUENCE_MAX_HIDDEN)


# The widest fp32 encoder (its hidden size) that runs every batch a sequence at a time (wider ones only a text served
# alone: `fused.FusedEncoder.by_sequence_fp32`). Each sequence reads every layer's weights, four times int8's bytes:
# BERT-tiny's layer (0.8 MB) stays in a core's L2, mini's (3.1 MB) and MiniLM-L6's (7 MB) do not. Encoders alone on a
# 2-core Zen 4, against the same layers operator by operator (oneDNN's products over the batch, the kernels' for a few
# rows), in one process, two runs: 64 texts of 27-30 tokens, BERT-tiny 1.08-1.32x, mini (256 wide) 0.88-1.01x,
# MiniLM-L6 0.72x; one text of 27 tokens 1.25-1.39x, 1.04-1.33x, 0.98-1.03x, of 64 tokens 1.21-1.28x, 0.88-0.98x,
# 0.99-1.00x. The AVX2 build (oneDNN held to AVX2 too): 64 texts 1.17-1.20x, 1.06-1.09x, 0.82-0.83x; one text
# 1.17-1.24x, 1.05-1.08x, 1.07x. On a 2-core Xeon (AVX-512, the kernels' products for any layer's few rows) one
# MiniLM-L6 text of 27 tokens, end to end in three runs: 1.04x, 1.07x, 1.10x sooner, the same bits.
FP32_SEQUENCE_MAX_HIDDEN = 128


FUSE_FP32 = True  # False: fp32 models prepared from now on run packed on PyTorch's operators (a side-by-side run)


def _swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Every nn.Linear of `model` replaced by `make(linear)`, in place."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, make(child))
        else:
            _swap_linears(child, make)
    return model


def pack_linears(model: nn.Module) -> nn.Module:
    """Every nn.Linear of a CPU model replaced by a `PackedLinear` in the model's dtype, in place (unchanged
    where torch lacks the oneDNN operators). For inference: the packed weights take no gradient."""
    if not _has_onednn_ops():
        return model
    return _swap_linears(model, lambda lin: PackedLinear(lin, lin.weight.dtype))


def quantize_int8(model: nn.Module) -> nn.Module:
    """Dynamic int8 quantization of every nn.Linear, in place: weights int8 per output channel, once;
    activations quantized per batch, per tensor (per row on CPUs without int8 dot products, and on AVX-512 VNNI
    CPUs where bertforge's kernels load, with AMX for small products and encoders up to `SEQUENCE_MAX_HIDDEN` wide
    only); CPU only.
    Embeddings, LayerNorm and the MLM decoder (tied to the word embeddings, a plain matrix product) stay fp32, and
    so does attention, except over short sequences on a CPU that multiplies bf16 natively (`_bf16_attention`).

    Per-channel weights, not per-tensor: on fine-tuned MiniLM (rotten-tomatoes test) they kept 95.9% of
    fp32's predicted labels instead of 93.3%, at the same speed. On x86 the layers are `Int8Linear`, on
    oneDNN, with 8-bit activations and 8-bit weights where the CPU has int8 dot products into int32, 7-bit
    weights with AVX2 alone (`bertforge.cpu.int8_weight_bits`). On an AVX2 AMD EPYC without VNNI that kept
    fine-tuned MiniLM within 0.3 points of fp32 on Rotten Tomatoes dev and test (torch's fbgemm layers, which
    take 7-bit activations instead: -0.9 on dev) at about their speed (1.04x); where bertforge's kernels load,
    such CPUs quantize activations to 7 bits per row instead (`Int8Linear`), as accurate and faster. Elsewhere (no
    oneDNN operators or no x86 flags) torch's fbgemm/qnnpack layers, 7-bit activations."""
    bits = cpu.int8_weight_bits()
    if bits is not None and _has_onednn_ops():
        _swap_linears(model, functools.partial(Int8Linear, weight_bits=bits))
        _fuse_gelu(model)
        _bf16_attention(model)
        _fuse_int8_encoders(model)
        _one_pass_quantizer()  # here, once, not first in two batch streams at once (it swaps warning filters)
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8,
                                mapping={nn.Linear: DynamicLinear}, inplace=True)


def prepare(model: nn.Module, options: EngineOptions, device: torch.device) -> nn.Module:
    """The model in its inference form for `options` on `device` (`checks.engine_device`): in the dtype of its
    precision, its Linear layers int8 (quantize, CPU) or, on the CPU, packed for oneDNN, its fp32 encoders run on
    the kernels between their products (`fused`) where they load and the others on real tokens only (`packing`)."""
    model = model.to(device=device, dtype=inference_dtype(options.precision, device, options.quantize))
    if options.quantize == "int8":
        return quantize_int8(model)
    if device.type != "cpu":
        return model
    model = pack_linears(model)
    _fuse_gelu(model)
    _fuse_fp32_encoders(model)  # on the kernels between the products where they load
    kernel_attention(model, _bf16_packed)  # bf16 ones' attention on the kernels where they load
    return pack_sequences(model)  # the encoders left: on real tokens only
