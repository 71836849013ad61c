"""Inference on new text: fill-mask, task predictions (classification, regression, NER, QA, multiple choice)
and embeddings, from Python and the command line.

Speed on CPU comes from five choices, each measured by bench/inference.py (the kernels by bench/int8_kernels.py):
- no computing on padding beyond what a batch needs: inputs are sorted by length and batched by a token
  budget, so each batch is padded only to its own longest sequence, and results are put back in input order;
- every Linear layer's weight laid out once for oneDNN's matrix kernels (`pack_linears`): the matrix products
  are most of the time on short texts, and torch's nn.Linear hands fp32 ones to MKL, which packs the weight
  anew on every call (on the AMD EPYC we measure on, 1.2-1.4x slower than oneDNN on the packed weight);
- a narrower number format where the CPU multiplies it natively: `precision="bf16"` (the whole model in
  bfloat16, on CPUs with AVX512-BF16 or AMX) or `quantize="int8"` (int8 Linear layers on oneDNN, the rest
  fp32: 8-bit weights with VNNI's int32 sums, 7-bit weights on AVX2, whose int16 pair sums would saturate;
  attention over short texts in bf16 where the CPU has it, which is faster there than fp32's fused kernel);
- for int8 on an AVX512 CPU, bertforge's own kernels between the products (`bertforge.kernels`, built on first
  use): each layer's attention in one pass per sequence, each residual add + LayerNorm in one pass per row, and
  the activation ranges handed to the next product (`FusedInt8Encoder`);
- two batches at a time, each on half the threads, where there are 2 or more threads and 4 or more batches
  (`bertforge.streams`): small products use a CPU's threads better side by side than split.
"""

from __future__ import annotations

import functools
import gc
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

from bertforge import cpu
from bertforge.checkpoint import load_state, read_weights
from bertforge.config import BertConfig
from bertforge.data.padding import pad_ids
from bertforge.device import pick_device, refuse_emulated_cpu_bf16
from bertforge.errors import BertforgeError
from bertforge.heads import BertForMaskedLM
from bertforge.io import open_text
from bertforge.model import BertEncoder, BertLayer, BertModel, BertSelfAttention
from bertforge.options import INFERENCE_PRECISIONS
from bertforge.streams import cpu_streams, run_batches
from bertforge.tasks.runner import TaskModel, load_task, load_task_model, run_model
from bertforge.tokenizer import Tokenizer

# Length-grouped batching: a batch holds at most MAX_TOKENS padded tokens and MAX_BATCH sequences.
MAX_TOKENS = 8192
MAX_BATCH = 256



@functools.cache
def _has_onednn_ops() -> bool:
    """Does this torch build have the oneDNN operators `PackedLinear` and `Int8Linear` call (torch's own
    compiler calls them for CPU code; they are not a public API, so their absence means plain nn.Linear)?"""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.onednn, "qlinear_pointwise"))


class PackedLinear(nn.Module):
    """An nn.Linear for CPU inference: its weight reordered once, in fp32 or bf16, into the blocked layout of
    oneDNN's matrix kernels, which then read it as it is on every call. The product is nn.Linear's in the
    weight's dtype (fp32: the same to rounding, max |difference| ~1e-6 on unit-scale inputs)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # a oneDNN tensor (layout torch._mkldnn), not a Parameter: state_dict and .to() do not apply to it
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(dtype))
        self.bias = None if linear.bias is None else linear.bias.detach().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class Int8Linear(nn.Module):
    """A dynamically quantized Linear on oneDNN's int8 kernels. The weight is int8, symmetric per output
    channel with `weight_bits` bits (8: codes within +-127; 7: within +-63), reordered once; activations are
    quantized per call to all 8 bits (u8, per tensor, the zero point placed by the batch's min and max, a
    range that always holds 0); the output is fp32. With VNNI the products are summed in int32; on AVX2 the
    kernel first sums pairs of u8 x s8 products in int16, which 7-bit weights keep from saturating
    (`bertforge.cpu.int8_weight_bits`). `activation="gelu"` applies the exact (erf) GELU inside the kernel.
    `bf16_max_positions`: the output is bf16 instead, for inputs (..., T, in) of at most this many positions T
    (0: never), for the attention's explicit bf16 kernel (`quantize_int8`). `kernels`: fp32 inputs' range and
    codes come from bertforge's kernels (`FusedInt8Encoder` sets it): the same codes up to a code off by one at a
    rounding boundary, faster (on 6,912 x 1,536, one thread: the range 1.3x torch.aminmax's speed, the codes 1.2x
    torch.quantize_per_tensor's)."""

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
        self.weight = torch.ops.onednn.qlinear_prepack(q, None)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.activation = "none"
        self.bf16_max_positions = 0
        self.kernels = False

    def forward(self, x: torch.Tensor, bounds: torch.Tensor | None = None) -> torch.Tensor:
        """bounds: x's (min, max) where the caller already has them (the fused kernels give them)."""
        if bounds is None:
            bounds = torch.ops.bertforge.value_range(x) if self.kernels else torch.aminmax(x)
        lo, hi = min(float(bounds[0]), 0.0), max(float(bounds[1]), 0.0)
        scale = (hi - lo) / 255 or 1.0
        zero = round(-lo / scale)
        codes = torch.ops.bertforge.quantize_u8(x, scale, zero) if self.kernels else _u8_codes(x.float(), scale, zero)
        out = torch.bfloat16 if x.dim() > 2 and x.shape[-2] <= self.bf16_max_positions else torch.float32
        return torch.ops.onednn.qlinear_pointwise(codes, scale, zero, self.weight, self.weight_scale,
                                                  self.weight_zero, self.bias, 1.0, 0, out,
                                                  self.activation, [], "none")


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


def _fuse_gelu(model: nn.Module) -> None:
    """The feed-forward GELU of every BertLayer moved into its int8 `intermediate` product (oneDNN applies it
    as the product is written, instead of a pass over the (B, T, I) output), where the layer's activation
    is the exact GELU: about 1.1x on the whole int8 model (bench/inference.py's MiniLM, 2 threads)."""
    for layer in model.modules():
        if isinstance(layer, BertLayer) and layer.act is F.gelu and isinstance(layer.intermediate, Int8Linear):
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


class FusedInt8Encoder(nn.Module):
    """A `BertEncoder` of int8 layers (its own modules, same weights) run on bertforge's CPU kernels
    (`bertforge.kernels`): each layer's attention in one pass per sequence, each residual add + LayerNorm in one
    pass per row, and the activation range each of them gives handed to the int8 product that follows, which
    then skips its own pass to find it. Post-LN and pre-LN layers alike. Batches longer than `max_positions` run
    the layers as they are."""

    def __init__(self, encoder: BertEncoder, max_positions: int):
        super().__init__()
        self.plain = encoder  # the same layers, run as they are past max_positions
        self.max_positions = max_positions

    @property
    def layer(self) -> nn.ModuleList:
        return self.plain.layer

    @property
    def final_norm(self) -> nn.LayerNorm | None:
        """Pre-LN layers: the LayerNorm after the last."""
        return self.plain.final_norm

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """As `BertEncoder.forward`: x (B, T, H), mask (B, 1, 1, T) bool or None, positions (B, P) or None."""
        if x.shape[1] > self.max_positions:
            return self.plain(x, mask, positions)
        keys = None if mask is None else mask[:, 0, 0, :]
        if self.final_norm is not None:
            return self._pre_ln(x, keys, positions)
        last = len(self.layer) - 1
        bounds = None
        for i, layer in enumerate(self.layer):
            x, bounds = _fused_int8_layer(layer, x, keys, positions if i == last else None, bounds)
        return x

    def _pre_ln(self, x: torch.Tensor, keys: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
        """Pre-LN layers, x = x + Attn(LN(x)); x = x + FFN(LN(x)), then the final LayerNorm: each LayerNorm fused
        with the residual add before it, keeping the sum as the residual stream."""
        ops = torch.ops.bertforge
        norm = self.layer[0].attention_norm
        x, normed, bounds = ops.residual_layer_norm(x, None, norm.weight, norm.bias, norm.eps)
        last = len(self.layer) - 1
        for i, layer in enumerate(self.layer):
            attention = layer.attention
            y, y_bounds = ops.attention(attention.qkv(normed, bounds), attention.num_heads, keys,
                                        positions if i == last else None)
            if i == last and positions is not None:
                x = x.gather(1, positions[..., None].expand(-1, -1, x.shape[2]))
            norm = layer.output_norm
            x, normed, bounds = ops.residual_layer_norm(layer.attention_out(y, y_bounds), x, norm.weight, norm.bias,
                                                        norm.eps)
            out = layer.output(layer.intermediate(normed, bounds))
            norm = self.final_norm if i == last else self.layer[i + 1].attention_norm
            x, normed, bounds = ops.residual_layer_norm(out, x, norm.weight, norm.bias, norm.eps)
        return normed


def _fused_int8_layer(layer: BertLayer, x: torch.Tensor, keys: torch.Tensor | None, positions: torch.Tensor | None,
                      bounds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`BertLayer.forward` (post-LN, eval) on the kernels: (output, its (min, max))."""
    ops = torch.ops.bertforge
    attention = layer.attention
    y, y_bounds = ops.attention(attention.qkv(x, bounds), attention.num_heads, keys, positions)
    if positions is not None:
        x = x.gather(1, positions[..., None].expand(-1, -1, x.shape[2]))
    norm = layer.attention_norm
    x, x_bounds = ops.add_layer_norm(layer.attention_out(y, y_bounds), x, norm.weight, norm.bias, norm.eps)
    norm = layer.output_norm
    return ops.add_layer_norm(layer.output(layer.intermediate(x, x_bounds)), x, norm.weight, norm.bias, norm.eps)


# The longest batches the fused int8 encoder runs; longer ones run PyTorch's operators.
FUSED_INT8_MAX_T = 512


def _fuse_int8_encoders(model: nn.Module) -> None:
    """Every BertEncoder of int8 layers with the feed-forward GELU inside the product (`_fuse_gelu`) and heads of
    a multiple of 16 replaced by a `FusedInt8Encoder`, where bertforge's CPU kernels are available. Their
    query/key/value products write fp32: the attention kernel takes bf16 too, 1.02-1.03x faster on the bench's
    MiniLM, but at 0.1-0.5 points of its Rotten Tomatoes dev accuracy in four measurements (fp32: +0.0 to +0.2;
    bench/int8_kernels.py)."""
    from bertforge import kernels

    def fusable(encoder: BertEncoder) -> bool:
        return all(
            isinstance(layer.intermediate, Int8Linear) and layer.intermediate.activation == "gelu"
            and isinstance(layer.act, nn.Identity) and all(
                isinstance(m, Int8Linear) for m in (layer.attention.qkv, layer.attention_out, layer.output))
            and layer.attention.head_size % 16 == 0  # so the hidden size too
            and layer.pre_ln == (encoder.final_norm is not None)
            for layer in encoder.layer)

    encoders = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
                if isinstance(child, BertEncoder) and fusable(child)]
    if not encoders or not kernels.available():
        return
    for parent, name, encoder in encoders:
        for layer in encoder.layer:
            layer.attention.qkv.bf16_max_positions = 0
            for product in (layer.attention.qkv, layer.attention_out, layer.intermediate, layer.output):
                product.kernels = True
        setattr(parent, name, FusedInt8Encoder(encoder, FUSED_INT8_MAX_T))


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
    activations quantized per batch, per tensor; CPU only. Embeddings, LayerNorm and the MLM decoder (tied
    to the word embeddings, a plain matrix product) stay fp32, and so does attention, except over short
    sequences on a CPU that multiplies bf16 natively (`_bf16_attention`).

    Per-channel weights, not per-tensor: on fine-tuned MiniLM (rotten-tomatoes test) they kept 95.9% of
    fp32's predicted labels instead of 93.3%, at the same speed. On x86 the layers are `Int8Linear`, on
    oneDNN, with 8-bit activations and 8-bit weights where the CPU has int8 dot products into int32, 7-bit
    weights with AVX2 alone (`bertforge.cpu.int8_weight_bits`). On an AVX2 AMD EPYC without VNNI that kept
    fine-tuned MiniLM within 0.3 points of fp32 on Rotten Tomatoes dev and test (torch's fbgemm layers, which
    take 7-bit activations instead: -0.9 on dev) at about their speed (1.04x). Elsewhere (no oneDNN
    operators or no x86 flags) torch's fbgemm/qnnpack layers, 7-bit activations."""
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


def _cyclic_gc_paused(method: Callable) -> Callable:
    """`method` with Python's cyclic garbage collector held off while it runs (as it was after). A call over a file
    builds many small objects (examples, features, token lists, results), all freed by reference counting, whose
    allocations set off collections that walk every object in the process, the model's and the libraries' included.
    Int8 predict over Rotten Tomatoes test ran 1.04x faster without them, and steadier (1,821-1,930 texts/s in six
    runs against 1,556-1,859; a throwaway A/B in one process)."""

    @functools.wraps(method)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return method(*args, **kwargs)
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            gc.enable()

    return paused


def length_batches(lengths: Sequence[int], *, max_tokens: int = MAX_TOKENS,
                   max_batch: int = MAX_BATCH) -> Iterator[np.ndarray]:
    """Indices grouped into batches of similar length, longest first, each within a padded-token budget
    (batch size x its longest sequence <= max_tokens; a sequence longer than the budget goes alone)."""
    if max_tokens < 1 or max_batch < 1:
        raise BertforgeError(f"max_tokens ({max_tokens}) and max_batch ({max_batch}) must be at least 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    i = 0
    while i < len(order):
        width = max(int(lengths[order[i]]), 1)
        size = max(1, min(max_batch, max_tokens // width))
        yield order[i:i + size]
        i += size


def _padded_batch(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of `pad_ids`, on `device`."""
    ids, mask = pad_ids(rows, pad_id)
    return ids.to(device), mask.to(device)


BACKENDS = ("torch", "onnx")


def _check_backend(backend: str, device: str | None, precision: str) -> None:
    """`backend` is one of BACKENDS and goes with `device` and `precision`."""
    if backend not in BACKENDS:
        raise BertforgeError(f"--backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "onnx" and device not in (None, "cpu"):
        raise BertforgeError("--backend onnx runs ONNX Runtime on the CPU: drop --device, or --backend for the GPU")
    if backend == "onnx" and precision == "bf16":
        raise BertforgeError("--backend onnx runs fp32 or int8 (--quantize int8): drop --precision bf16, or "
                             "--backend onnx for bf16 on bertforge's own engine")


def _auto_streams(backend: str, device: torch.device, batches: int) -> int:
    """Batches run at once: `cpu_streams` on bertforge's engine; one on ONNX Runtime, whose session already
    has all the threads."""
    return 1 if backend == "onnx" else cpu_streams(device, batches)


def _check_quantize(quantize: str | None) -> None:
    if quantize not in (None, "none", "int8"):
        raise BertforgeError(f"--quantize {quantize!r}: only int8 is supported")


def _check_options(quantize: str | None, device: str | None, precision: str = "fp32") -> torch.device:
    """The device inference runs on, once `quantize`, `device` and `precision` are known to go together."""
    _check_quantize(quantize)
    if precision not in INFERENCE_PRECISIONS:
        raise BertforgeError(f"--precision {precision!r}: use one of {', '.join(INFERENCE_PRECISIONS)}")
    if quantize == "int8" and device not in (None, "cpu"):
        raise BertforgeError("--quantize int8 runs on the CPU only: drop --device or --quantize")
    if quantize == "int8" and precision == "bf16":
        raise BertforgeError("--quantize int8 picks the number formats around its int8 products itself (fp32, and "
                             "bf16 where that is faster and the CPU multiplies it natively): drop --precision bf16, "
                             "or --quantize for bf16 alone")
    where = torch.device("cpu") if quantize == "int8" else pick_device(device)
    refuse_emulated_cpu_bf16(precision, where)
    if precision == "bf16" and where.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise BertforgeError("--precision bf16: this GPU does not support bf16; use --precision fp32 or auto")
    return where


def inference_dtype(precision: str, device: torch.device, quantize: str | None = None) -> torch.dtype:
    """The dtype a model runs in for `precision` on `device`: `auto` is bf16 where the hardware multiplies bf16
    natively (a CPU with AVX512-BF16 or AMX, a CUDA GPU with bf16) and fp32 elsewhere; around int8 Linear
    layers (`quantize`) the model stays fp32.

    bf16 keeps 8 significant bits (each value rounded by up to 2^-8 of itself); on the fine-tuned MiniLM
    classifier of bench/inference.py its Rotten Tomatoes accuracy stayed within 0.3 points of fp32 on dev and
    test."""
    if precision == "auto" and quantize != "int8":
        native = cpu.has_native_bf16() if device.type == "cpu" else \
            device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if native else torch.float32
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _load(cls, path: str | Path) -> tuple[nn.Module, list[str]]:
    """(model in eval mode, names of the weights the directory lacked), reading the weights once."""
    path = Path(path)
    if not path.is_dir():
        raise BertforgeError(f"model directory {path} does not exist: pass the --out directory of "
                             "`bertforge pretrain` or `bertforge finetune`")
    model = cls(BertConfig.from_json(path))
    fresh = load_state(model, read_weights(path), source=str(path), verbose=False)
    return model.eval(), fresh


def load_encoder(path: str | Path) -> BertModel:
    """The encoder of any model directory (pretrained or fine-tuned; heads ignored), in eval mode, without a
    pooler where the directory has no pooler weights: a randomly initialised one is never used or exported."""
    model, fresh = _load(BertModel, path)
    if any(k.startswith("pooler.") for k in fresh):
        model.pooler = None
    return model


def _prepare(model: nn.Module, quantize: str | None, device: torch.device, precision: str) -> nn.Module:
    """The model in its inference form: on `device` in the dtype of `precision`, its Linear layers int8
    (`quantize`, CPU) or, on the CPU, packed for oneDNN."""
    model = model.to(device=device, dtype=inference_dtype(precision, device, quantize))
    if quantize == "int8":
        return quantize_int8(model)
    return pack_linears(model) if device.type == "cpu" else model


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")  # a fully quantized model has no nn.Parameter left outside packed weights


def _texts(records: Sequence[dict], source: str) -> list[str]:
    texts = []
    for n, r in enumerate(records, 1):
        text = r.get("text")
        if not isinstance(text, str):
            raise BertforgeError(f"{source}: input {n} has no \"text\" string (keys: {sorted(r)})")
        texts.append(text)
    return texts


class Encoder:
    """A model directory's encoder for embeddings: `Encoder("runs/mini").embed(["a text", ...])`.

    Any model directory works (pretrained or fine-tuned; heads are ignored). `pooling="pooler"` needs the
    pooler weights (BERT pretrained with NSP has them, a masked-LM-only model does not). `precision`,
    `quantize` and `backend` as for `Predictor` (with `backend="onnx"`, `path` may also be an encoder's
    `bertforge export` directory).
    """

    def __init__(self, path: str | Path, *, quantize: str | None = None, device: str | None = None,
                 precision: str = "fp32", max_length: int = 512, backend: str = "torch"):
        _check_backend(backend, device, precision)
        self.tokenizer = Tokenizer.from_pretrained(path)
        config = BertConfig.from_json(path)
        self.tokenizer.check_compatible(config)
        self.max_length = min(max_length, config.max_position_embeddings)
        self.hidden_size = config.hidden_size
        self.backend = backend
        if backend == "onnx":
            from bertforge.ort import load_ort_model

            _check_quantize(quantize)
            self.model = load_ort_model(Path(path), quantize, encoder=True)
            return
        where = _check_options(quantize, device, precision)
        self.model = _prepare(load_encoder(path), quantize, where, precision)

    @torch.no_grad()
    @_cyclic_gc_paused
    def embed(self, texts: Sequence[str], *, pooling: str = "cls", normalize: bool = False,
              max_tokens: int = MAX_TOKENS) -> np.ndarray:
        """(N, H) float32, row i for texts[i]: the final [CLS] state (`cls`), the mean of the real tokens'
        final states, [CLS] and [SEP] included (`mean`), or the pooler's output (`pooler`). Texts longer
        than max_length tokens are truncated. `normalize` scales each row to unit length."""
        if pooling not in ("cls", "mean", "pooler"):
            raise BertforgeError(f"pooling {pooling!r} is not one of cls, mean, pooler")
        if pooling == "pooler" and self.model.pooler is None:
            raise BertforgeError("this model has no pooler weights: use --pooling cls or mean")
        if isinstance(texts, str):
            raise TypeError("embed() takes a list of texts; wrap a single text in a list")
        rows = self.tokenizer.encode_batch(list(texts), max_length=self.max_length, padding=False).ids
        out = np.zeros((len(rows), self.hidden_size), dtype=np.float32)
        device = _device_of(self.model)
        batches = list(length_batches([len(r) for r in rows], max_tokens=max_tokens))

        def run(idx: np.ndarray) -> None:
            ids, mask = _padded_batch([rows[i] for i in idx], self.tokenizer.pad_id, device)
            res = self.model(ids, attention_mask=mask, cls_only=pooling != "mean")
            if pooling == "cls":
                vec = res.sequence_output[:, 0]
            elif pooling == "pooler":
                vec = res.pooled_output
            else:
                m = mask.unsqueeze(-1).float()  # (B, T, 1)
                vec = (res.sequence_output.float() * m).sum(1) / m.sum(1)  # summed in fp32 under bf16 too
            out[idx] = vec.float().cpu().numpy()

        run_batches(run, batches, _auto_streams(self.backend, device, len(batches)))
        if normalize:
            out /= np.linalg.norm(out, axis=1, keepdims=True).clip(min=1e-12)
        return out


class MaskFiller:
    """`MaskFiller("runs/mini").fill("the [MASK] of the union", top_k=5)`: the likeliest tokens per [MASK].

    The MLM head runs on the [MASK] positions only (not on every token), so its vocabulary-sized output
    costs nothing for the rest of the text. `precision` and `quantize` as for `Predictor`.
    """

    def __init__(self, path: str | Path, *, quantize: str | None = None, device: str | None = None,
                 precision: str = "fp32"):
        where = _check_options(quantize, device, precision)
        model, fresh = _load(BertForMaskedLM, path)
        if any(k.startswith("cls.predictions.") for k in fresh):
            raise BertforgeError(f"{path} has no masked-LM head (cls.predictions.*): fill-mask needs a model from "
                                 "`bertforge pretrain` (or a Hugging Face BertForMaskedLM/BertForPreTraining)")
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.tokenizer.check_compatible(model.config)
        self.max_length = model.config.max_position_embeddings
        self.model = _prepare(model, quantize, where, precision)

    @torch.no_grad()
    @_cyclic_gc_paused
    def fill(self, texts: str | Sequence[str], *, top_k: int = 5,
             max_tokens: int = MAX_TOKENS) -> list[list[dict]] | list[list[list[dict]]]:
        """Per text, per [MASK] in it (left to right), the top_k {"token", "score"}, most probable first
        (score = the softmax probability over the whole vocabulary). A single string gives that text's list."""
        if top_k < 1:
            raise BertforgeError(f"--top-k {top_k} must be at least 1")
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        tok = self.tokenizer
        rows = tok.encode_batch(texts, max_length=self.max_length, padding=False).ids
        for t, r in zip(texts, rows, strict=True):
            if tok.mask_id not in r:
                where = "" if "[MASK]" not in t else f" within its first {self.max_length} tokens"
                raise BertforgeError(f"no [MASK] token in {_short(t)!r}{where}: write [MASK] where a word should be "
                                     "predicted")
        results: list[Any] = [[] for _ in texts]
        device = _device_of(self.model)
        for idx in length_batches([len(r) for r in rows], max_tokens=max_tokens):
            ids, mask = _padded_batch([rows[i] for i in idx], tok.pad_id, device)
            labels = torch.where(ids == tok.mask_id, ids, torch.full_like(ids, -100))  # selects [MASK]s
            logits = self.model(ids, attention_mask=mask, labels=labels).logits  # (M, V), row-major
            scores, top = logits.float().softmax(-1).topk(min(top_k, logits.shape[-1]), dim=-1)  # (M, k)
            batch_rows = (labels != -100).nonzero()[:, 0].tolist()  # row-major: masks left to right
            for row, ps, ts in zip(batch_rows, scores.tolist(), top.tolist(), strict=True):
                results[int(idx[row])].append([{"token": tok.id_to_token(t), "score": p}
                                               for t, p in zip(ts, ps, strict=True)])
        return results[0] if single else results


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def read_input_records(path: str | Path) -> list[dict]:
    """Input records from a file: JSONL (one object per line, e.g. {"text": ...}) when the file is named
    .jsonl/.json or its first non-blank line is a JSON object; otherwise plain text, one {"text"} per
    non-blank line."""
    path = Path(path)
    if not path.is_file():
        raise BertforgeError(f"input file {path} does not exist")
    with open_text(path) as f:
        lines = [(n, line.strip()) for n, line in enumerate(f, 1) if line.strip()]
    if not lines:
        raise BertforgeError(f"{path} holds no inputs")
    if path.suffix.lower() not in (".jsonl", ".json") and not _is_json_object(lines[0][1]):
        return [{"text": line} for _, line in lines]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BertforgeError(f"{path}:{n} is not valid JSON ({e.msg}); write one object per line") from None
        if not isinstance(record, dict):
            raise BertforgeError(f"{path}:{n}: expected a JSON object like {{\"text\": ...}}")
        records.append(record)
    return records


def _is_json_object(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _example(task, record: dict, n: int):
    def need(*keys):
        for key in keys:
            if record.get(key) in (None, ""):
                raise BertforgeError(f"input {n}: {task.name} needs {' and '.join(repr(k) for k in keys)} "
                                     f"(got keys {sorted(record)})")

    if task.kind == "question_answering":
        question = record.get("question", record.get("text"))
        context = record.get("context", record.get("text_pair"))
        if not question or not context:
            raise BertforgeError(f"input {n}: question answering needs a question (--text) and a context "
                                 f"(--text-pair)")
        return task.example(question, context)
    if task.kind == "multiple_choice":
        need("context", "choices")
        return task.example(record["context"], list(record["choices"]))
    need("text")
    if task.kind == "token_classification":
        return task.example(record["text"])
    return task.example(record["text"], record.get("text_pair"))


class Predictor:
    """A fine-tuned model directory (from `bertforge finetune`), loaded once for many predictions:
    `Predictor("runs/sst2").predict([{"text": "a gorgeous, witty film"}])`. The task (and so the output) is
    read from the directory's task.json; see `predict`.

    The same options as `Encoder` and `MaskFiller`: `precision` fp32 (the default), bf16 (about twice as
    fast on CPUs with AVX512-BF16 or AMX) or auto (bf16 where the hardware has it); `quantize="int8"` (CPU)
    makes the Linear layers int8 and keeps the rest fp32 (attention over short texts bf16 on CPUs with
    AVX512-BF16 or AMX); bench/inference.py measures each against ONNX Runtime, with its accuracy.
    `backend="onnx"` runs the model on ONNX Runtime instead (CPU, fp32 or int8; `path` an exported directory
    or a fine-tuned one, exported on the way: `bertforge.ort`)."""

    def __init__(self, path: str | Path, *, quantize: str | None = None, device: str | None = None,
                 precision: str = "fp32", backend: str = "torch"):
        _check_backend(backend, device, precision)
        self.backend = backend
        if backend == "onnx":
            self.task_model = _load_ort_task_model(Path(path), quantize)
        else:
            where = _check_options(quantize, device, precision)
            self.task_model = load_task_model(path, device=str(where))
            self.task_model.model = _prepare(self.task_model.model, quantize, where, precision)
        self.task = self.task_model.task

    @torch.no_grad()
    @_cyclic_gc_paused
    def predict(self, records: Sequence[dict], *, batch_size: int = 64, streams: int | None = None) -> list[dict]:
        """One result per record, in order. `streams`: batches run at once, each on its share of the threads
        (default: 2 on a CPU with 2 or more threads and 4 or more batches, else 1; `bertforge.streams`). Records
        and results by the task's kind:

        classification   {"text", "text_pair"?} -> {"label", "score", "probabilities": {label: p}}
        regression       {"text", "text_pair"?} -> {"score"}
        token tagging    {"text"} -> {"entities": [{"type", "start", "end", "text"}], "tags": [[word, tag]]}
                         (start/end: character offsets into the text)
        question answer  {"question", "context"} -> {"answer", "start", "end", "score"} (offsets in context)
        multiple choice  {"context", "choices"} -> {"choice", "probabilities"}
        """
        tm, task = self.task_model, self.task
        if not records:
            return []
        examples = [_example(task, r, n) for n, r in enumerate(records, 1)]
        for n, ex in enumerate(examples):
            ex.id = str(n)
        label_map = task.label_map() if task.labels and task.kind in ("classification", "token_classification") \
            else None
        features = task.features(examples, tm.tokenizer, tm.max_length, label_map)
        device = _device_of(tm.model)
        if streams is None:
            streams = _auto_streams(self.backend, device, -(-len(features) // batch_size))
        elif streams < 1:
            raise BertforgeError(f"streams must be at least 1, not {streams}")
        outputs = run_model(tm.model, features, tm.tokenizer.pad_id, batch_size=batch_size, device=device,
                            streams=streams)
        return _results(task, examples, features, outputs)


def _results(task, examples: list, features: list, outputs: Any) -> list[dict]:
    if task.kind == "classification":
        probs = torch.tensor(np.asarray(outputs)).float().softmax(-1).numpy()
        return [{"label": task.labels[int(p.argmax())], "score": float(p.max()),
                 "probabilities": {lab: float(v) for lab, v in zip(task.labels, p, strict=True)}} for p in probs]
    if task.kind == "regression":
        return [{"score": float(v)} for v in np.asarray(outputs).reshape(-1)]
    if task.kind == "multiple_choice":
        probs = torch.tensor(np.asarray(outputs)).float().reshape(len(examples), -1).softmax(-1).numpy()
        return [{"choice": int(p.argmax()), "probabilities": [float(v) for v in p]} for p in probs]
    if task.kind == "token_classification":
        tags = task.decode(examples, features, outputs)
        return [{"entities": task.entities(ex, t), "tags": [list(wt) for wt in zip(ex.words, t, strict=True)]}
                for ex, t in zip(examples, tags, strict=True)]
    best = task.nbest(examples, features, outputs)
    return [{"answer": b[0]["text"], "start": b[0]["start"], "end": b[0]["end"], "score": b[0]["probability"]}
            if b else {"answer": "", "start": None, "end": None, "score": 0.0} for b in best]


def predict_records(path: str | Path, records: Sequence[dict], *, batch_size: int = 64,
                    device: str | None = None, quantize: str | None = None, precision: str = "fp32",
                    backend: str = "torch") -> list[dict]:
    """Predictions of a fine-tuned model directory for input records: `Predictor(path).predict(records)`."""
    predictor = Predictor(path, quantize=quantize, device=device, precision=precision, backend=backend)
    return predictor.predict(records, batch_size=batch_size)


def _load_ort_task_model(path: Path, quantize: str | None) -> TaskModel:
    """A fine-tuned directory, or its ONNX export, as a TaskModel whose model is an ONNX Runtime session."""
    from bertforge.ort import load_ort_model

    _check_quantize(quantize)
    task, spec = load_task(path)
    tokenizer = Tokenizer.from_pretrained(path)
    tokenizer.check_compatible(BertConfig.from_json(path))
    model = load_ort_model(path, quantize if quantize == "int8" else None)
    return TaskModel(task, model, tokenizer, int(spec.get("max_length", task.max_length)), spec)
