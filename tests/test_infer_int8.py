"""int8 inference on PyTorch's operators (bertforge's C++ kernels: test_kernels.py): the quantized engines stay
close to fp32, Int8Linear's activation codes and weight bits follow the CPU, bf16 where the CPU has it.

The models are conftest's `mlm_dir` (tiny, random, over a vocabulary of whole words) and single layers made here.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from infer_support import MASKED, TEXTS, activation_codes, cosines, row_codes
from torch import nn

import bertforge.cpu
import bertforge.infer.transforms
import bertforge.kernels
from bertforge import BertforgeError
from bertforge.infer import Encoder, EngineOptions, Int8Linear, MaskFiller, quantize_int8
from bertforge.infer.transforms import FEW_ROWS, _has_onednn_ops

# --- int8 ----------------------------------------------------------------------------------------------


def test_int8_stays_close_to_fp32(mlm_dir):
    fp32 = Encoder(mlm_dir).embed(TEXTS, pooling="mean")
    int8 = Encoder(mlm_dir, EngineOptions(quantize="int8")).embed(TEXTS, pooling="mean")
    assert isinstance(Encoder(mlm_dir, EngineOptions(quantize="int8")).model.encoder.layer[0].intermediate,
                      (Int8Linear, torch.ao.nn.quantized.dynamic.Linear))
    # Seen on this tiny random model: max abs difference 8e-4 on vectors of std 0.66, cosine 0.9999999; top-1
    # probabilities within 1.2e-3, same top-1 tokens. (On fine-tuned MiniLM: bench/inference.py.)
    assert cosines(fp32, int8).min() > 0.9999 and np.abs(fp32 - int8).max() < 0.01
    a = MaskFiller(mlm_dir).fill(MASKED, top_k=1)
    b = MaskFiller(mlm_dir, EngineOptions(quantize="int8")).fill(MASKED, top_k=1)
    assert np.abs(np.array([m[0]["score"] for t in a for m in t]) - [m[0]["score"] for t in b for m in t]).max() < 0.01
    with pytest.raises(BertforgeError, match="CPU only"):
        EngineOptions(quantize="int8", device="cuda")
    with pytest.raises(BertforgeError, match="only int8"):
        EngineOptions(quantize="int4")


@pytest.mark.skipif(not bertforge.cpu.has_native_bf16(), reason="this CPU has no bf16 dot products")
def test_fill_mask_in_bf16_keeps_the_top_tokens(mlm_dir):
    """The masked-LM head in bf16 too (the tolerances are derived on real text in test_infer_fast.py): the same
    top-1 token wherever fp32 puts it clearly first, and top scores within 16 bf16 roundings (16 x 2^-8 of
    themselves) of fp32's."""
    fp32 = [m for t in MaskFiller(mlm_dir).fill(MASKED, top_k=2) for m in t]
    bf16 = [m for t in MaskFiller(mlm_dir, EngineOptions(precision="bf16")).fill(MASKED, top_k=2) for m in t]
    for a, b in zip(fp32, bf16, strict=True):
        if a[0]["score"] > 1.5 * a[1]["score"]:
            assert a[0]["token"] == b[0]["token"]
        assert abs(a[0]["score"] - b[0]["score"]) < 16 * 2 ** -8 * a[0]["score"]


@pytest.mark.parametrize("one_pass", [True, False])
def test_int8_activation_codes(one_pass, monkeypatch):
    """Both ways of quantizing activations (torch's one-pass quantizer, and the passes used without it) give the
    codes worked out by hand, a code off by one at most where the value sits on a rounding boundary, and the
    range's ends at codes 0 and 255."""
    monkeypatch.setattr(bertforge.infer.transforms, "_one_pass_quantizer", lambda: one_pass)
    torch.manual_seed(0)
    for x in (torch.randn(64, 37, 48) * 3 - 1, torch.rand(300, 20) + 2, -torch.rand(10, 9), torch.zeros(4, 5)):
        expected, scale, zero = activation_codes(x)
        codes = bertforge.infer.transforms._u8_codes(x, scale, zero)
        assert codes.dtype == torch.uint8 and codes.shape == x.shape
        off = (codes.double() - expected).abs()
        assert off.max() <= 1 and (off > 0).double().mean() < 1e-3
        assert x.min() >= 0 or codes.min() == 0  # a negative minimum is the range's lower end
        assert x.max() <= 0 or codes.max() == 255  # a positive maximum its upper end


def test_int8_weight_bits_follow_the_cpu(monkeypatch):
    """8-bit weights where the CPU sums int8 products into int32, 7-bit on AVX2 alone, torch's fbgemm layers
    where neither is known; 8-bit weights halve the weight rounding of 7 bits."""
    native = bertforge.cpu.int8_weight_bits()
    torch.manual_seed(0)
    layer = nn.Linear(512, 64)
    x = torch.randn(16, 512)

    def quantized(bits: int | None) -> nn.Module:
        monkeypatch.setattr(bertforge.cpu, "int8_weight_bits", lambda: bits)
        return quantize_int8(nn.Sequential(copy.deepcopy(layer)))[0]

    assert isinstance(quantized(None), torch.ao.nn.quantized.dynamic.Linear)
    if not _has_onednn_ops():
        return
    for bits in (7, 8):
        q = quantized(bits)
        assert isinstance(q, Int8Linear)
        # the packed weight is opaque: its scale says how many codes the largest weight of each row was cut to
        np.testing.assert_allclose(q.weight_scale, layer.weight.detach().abs().amax(1) / (2 ** (bits - 1) - 1),
                                   rtol=1e-6)
    if native == 8:
        # against the layer on the activations as Int8Linear quantizes them (u8 per tensor, the range's ends
        # at codes 0 and ~255), so that what is left is the weights' rounding: 8-bit activations' own rounding
        # is as large (on AVX512-VNNI it made the error against fp32 inputs only 18% smaller with 8-bit weights)
        codes, scale, zero = activation_codes(x)
        x_seen = ((codes - zero) * scale).float()
        with torch.no_grad():
            err7, err8 = ((quantized(b)(x) - layer(x_seen)).abs().mean() for b in (7, 8))
        assert err8 < 0.75 * err7


@pytest.mark.parametrize("native_bf16", [True, False])
def test_int8_attention_runs_in_bf16_on_short_sequences_where_the_cpu_has_bf16(mlm_dir, native_bf16, monkeypatch):
    """With native bf16, each int8 query/key/value product writes bf16 for sequences of up to
    INT8_BF16_ATTENTION_MAX_T positions (the attention then takes the explicit bf16 kernel) and fp32 beyond; without
    it, fp32 always. Either way the embeddings stay as close to fp32's as test_int8_stays_close_to_fp32 asks. (This
    is the int8 model on PyTorch's operators alone; on bertforge's kernels, test_kernels.py.)"""
    if bertforge.cpu.int8_weight_bits() is None or not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    if native_bf16 and not bertforge.cpu.has_native_bf16():
        pytest.skip("the int8 model takes bf16 attention only where the CPU multiplies bf16 natively, not here")
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(bertforge.kernels, "available", lambda: False)
    encoder = Encoder(mlm_dir, EngineOptions(quantize="int8"))
    qkv = encoder.model.encoder.layer[0].attention.qkv
    limit = bertforge.infer.transforms.INT8_BF16_ATTENTION_MAX_T
    with torch.no_grad():
        short, long = (qkv(torch.randn(2, t, qkv.in_features)) for t in (limit, limit + 1))
    assert short.dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    assert long.dtype == torch.float32
    assert encoder.model.encoder.layer[0].attention_out.bf16_max_positions == 0  # only the attention's inputs
    fp32 = Encoder(mlm_dir).embed(TEXTS, pooling="mean")
    int8 = encoder.embed(TEXTS, pooling="mean")
    assert cosines(fp32, int8).min() > 0.9999 and np.abs(fp32 - int8).max() < 0.01


def test_int8_linear_takes_bf16_inputs_as_their_fp32_values():
    """The attention's bf16 output feeds the next int8 product: quantized from the same range to the same codes
    as the fp32 tensor of the same values, so the same result."""
    if bertforge.cpu.int8_weight_bits() is None or not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    torch.manual_seed(0)
    q = Int8Linear(nn.Linear(64, 16), weight_bits=bertforge.cpu.int8_weight_bits())
    x = (torch.randn(3, 9, 64) * 2 - 0.5).bfloat16()
    with torch.no_grad():
        assert torch.equal(q(x), q(x.float()))


def _onednn_only(layer: nn.Linear, bits: int) -> Int8Linear:
    """`layer` as an Int8Linear on oneDNN's product at every row count (bertforge's VNNI and u7 kernels and fbgemm's
    few-row path off)."""
    with bertforge.infer.transforms.on_onednn():
        q = Int8Linear(layer, weight_bits=bits)
    q.few_rows = q.u7 = None
    return q


def test_int8_products_do_not_saturate_on_this_cpu():
    """The worst case for a kernel that sums pairs of u8 x s8 products in int16 (AVX2 without VNNI): every
    activation code near 255 and every weight at its largest code. With the weight bits this CPU gets
    (`bertforge.cpu.int8_weight_bits`) the output is the exact product of the quantized operands, up to fp32
    rounding; 8-bit weights on an AVX2-only CPU were off by 5.4 on outputs of size 21."""
    bits = bertforge.cpu.int8_weight_bits()
    if bits is None or not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    torch.manual_seed(0)
    layer = nn.Linear(384, 256)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(256, 384).sign() * 0.1)  # every weight code at +-(2^(bits-1) - 1)
    x = 3 + torch.rand(32, 384)  # codes from about 190 to 255, all positive: pairs of large products
    q = Int8Linear(layer, weight_bits=bits)
    top = 2 ** (bits - 1) - 1
    w = (layer.weight.detach().double() / q.weight_scale.double()[:, None]).round().clamp(-top, top)
    # every way this CPU multiplies: oneDNN's, and the one Int8Linear takes here where it is another: the VNNI kernels
    # (8-bit activations per row), the u7 kernels (7-bit activations per row) or fbgemm's for few rows
    paths = {"oneDNN": _onednn_only(layer, bits)}
    other = "vnni" if q.vnni is not None else "u7" if q.u7 is not None else "fbgemm" if q.few_rows is not None else None
    if other:
        paths[other] = q
    for name, product in paths.items():
        # all positive: zero point 0 per tensor and per row
        codes, scale, zero = {"u7": row_codes(x), "vnni": row_codes(x, bits=8)}.get(name) or activation_codes(x)
        exact = ((codes - zero) @ w.T) * scale * q.weight_scale.double() + layer.bias.detach().double()
        with torch.no_grad():
            y = product(x).double()
        assert float((y - exact).abs().max()) < 1e-3 * float(exact.abs().max()), name


def test_few_rows_run_on_fbgemm_with_the_same_codes(monkeypatch):
    """With 7-bit weights (CPUs without int8 dot products) up to FEW_ROWS rows, a text or two, run on fbgemm's
    int8 kernels, 1.2-2.5x oneDNN's speed there, on the same codes: activations quantized to all 8 bits by their
    range, so the exact product of the quantized operands, the GELU after it where the layer has it inside."""
    if not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    torch.manual_seed(0)
    layer = nn.Linear(48, 40)
    q = Int8Linear(layer, weight_bits=7)
    codes = (layer.weight.detach() / q.weight_scale[:, None]).round().clamp(-63, 63).to(torch.int8)
    q.u7 = None  # fbgemm where bertforge's kernels do not load (where they do: test_u7_products_...)
    q.few_rows = bertforge.infer.transforms._fbgemm_weight(codes, q.weight_scale, q.bias)
    if q.few_rows is None:
        pytest.skip("this torch has no fbgemm")
    assert Int8Linear(layer, weight_bits=8).few_rows is None  # int8 dot products: oneDNN alone
    assert Int8Linear(layer, weight_bits=8).u7 is None
    used = []
    product = torch.ops.quantized.linear_dynamic

    def recording(x, *args):
        used.append(x.shape[0])
        return product(x, *args)

    monkeypatch.setattr(torch.ops.quantized, "linear_dynamic", recording)
    w = (layer.weight.detach().double() / q.weight_scale.double()[:, None]).round().clamp(-63, 63)
    for activation in ("none", "gelu"):
        q.activation = activation
        for shape in [(1, 48), (3, 9, 48), (FEW_ROWS, 48), (FEW_ROWS + 1, 48)]:
            used.clear()
            x = torch.randn(shape) * 2
            with torch.no_grad():
                y = q(x)
            assert y.shape == (*shape[:-1], 40)
            codes, scale, zero = activation_codes(x.reshape(-1, 48))
            exact = ((codes - zero) @ w.T) * scale * q.weight_scale.double() + layer.bias.detach().double()
            exact = F.gelu(exact) if activation == "gelu" else exact
            assert float((y.reshape(-1, 40).double() - exact).abs().max()) < 1e-3 * float(exact.abs().max())
            assert used == ([] if x.numel() > FEW_ROWS * 48 else [x.numel() // 48])




def _per_row_cases(weight_bits: int):
    """(Int8Linear, its weight's codes in float64 as it rounds them, x (rows, in), its output (rows, out) in float64)
    over the cases the per-row kernels must take: input sizes not a multiple of 8, output sizes not of 16, leading
    shapes, bias or none, a row of zeros (its scale is any), with and without the GELU inside."""
    top = 2 ** (weight_bits - 1) - 1
    torch.manual_seed(0)
    for in_features, out_features, bias in ((48, 40, True), (37, 19, False), (1536, 384, True)):
        layer = nn.Linear(in_features, out_features, bias=bias)
        q = Int8Linear(layer, weight_bits=weight_bits)
        w = (layer.weight.detach() / q.weight_scale[:, None]).round().clamp(-top, top).double()
        for activation in ("none", "gelu"):
            q.activation = activation
            for shape in [(1, in_features), (3, 9, in_features), (300, in_features)]:
                x = torch.randn(shape) * 2
                x.view(-1, in_features)[0] = 0
                with torch.no_grad():
                    y = q(x)
                assert y.shape == (*shape[:-1], out_features) and y.dtype == torch.float32
                yield q, w, x.reshape(-1, in_features), y.reshape(-1, out_features).double()


def _exact_products(q: Int8Linear, w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor) -> torch.Tensor:
    """q's output from its activations' codes and its weight's codes, in float64: the exact products, scaled, the bias
    added, the GELU applied where q has it inside."""
    y = ((codes - zero) @ w.T) * scale * q.weight_scale.double()
    y = y if q.bias is None else y + q.bias.double()
    return F.gelu(y) if q.activation == "gelu" else y


def test_u7_products_are_the_exact_products_of_per_row_7_bit_codes(monkeypatch):
    """Without int8 dot products, where bertforge's kernels load, every row count runs on the u7 kernels: each row's
    activations in 7 bits by its own range, 7-bit weights, so the output is the exact product of those codes (a code
    off by one where a value sits on a rounding boundary: float32 against float64), the GELU after it; any input size
    (not a multiple of 8), output size (not of 16), leading shape, bias or none, a row of zeros."""
    if not bertforge.kernels.available():
        pytest.skip("bertforge's CPU kernels do not load here (the oneDNN and fbgemm paths are tested above)")
    for q, w, x, y in _per_row_cases(weight_bits=7):
        assert q.u7 is not None and q.few_rows is None
        codes, scale, zero = row_codes(x)
        exact = _exact_products(q, w, codes, scale, zero)
        # one code off moves an output by at most a row's scale x the largest weight row's code sum
        tolerance = float(scale.max() * w.abs().sum(1).max() * q.weight_scale.max()) + 1e-4
        assert float((y - exact).abs().max()) < tolerance
        assert ((y - exact).abs() < 1e-4 * (1 + exact.abs())).double().mean() > 0.99
    with pytest.raises(RuntimeError, match="x must be fp32"):
        torch.ops.bertforge.u7_linear(torch.ones(2, 48, dtype=torch.float64), *q.u7, q.weight_scale, None, 384)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.bertforge.u7_linear(torch.ones(2, 47), *q.u7, q.weight_scale, None, 384)
    for code in (64, -64, -128):  # -128 too, whose absolute value an int8 cannot hold
        with pytest.raises(RuntimeError, match="within"):
            torch.ops.bertforge.u7_pack(torch.full((4, 8), code, dtype=torch.int8))


def _float32_row_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit codes of x's rows (float64), their scales and zero points, computed in float32 as the VNNI kernels do:
    each value times the float32 reciprocal of its row's scale, rounded half to even, plus the zero point, within
    [0, 255]."""
    lo, hi = x.amin(1, keepdim=True).clamp(max=0), x.amax(1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / 255
    scale[scale == 0] = 1.0
    zero = torch.round(-lo / scale)
    return (torch.round(x * (1 / scale)) + zero).clamp(0, 255).double(), scale.double(), zero.double()


VNNI_SKIP = pytest.mark.skipif(not bertforge.infer.transforms.vnni_products(),
                               reason="bertforge's VNNI kernels run on AVX-512 CPUs with avx512_vnni, where the "
                                      "kernels load (elsewhere oneDNN's path, tested above)")


def _without_amx(monkeypatch) -> None:
    """This CPU's flags less AMX: Int8Linears made now run every product on the VNNI kernels."""
    flags = bertforge.cpu.cpu_flags()
    monkeypatch.setattr(bertforge.cpu, "cpu_flags", lambda: flags - {"amx_int8", "amx_bf16", "amx_tile"})


@VNNI_SKIP
def test_vnni_products_are_the_exact_products_of_per_row_8_bit_codes(monkeypatch):
    """With int8 dot products and no AMX, where bertforge's kernels load, 8-bit weights run on the VNNI kernels: each
    row's activations in 8 bits by its own range, so the output is the exact product of those codes (a code off by
    one where a value sits on a rounding boundary), the exact GELU after it where asked; any input size (not a
    multiple of 4), output size (not of 16), leading shape, bias or none, a row of zeros. A row's output does not
    depend on the rows beside it, nor on the number of threads."""
    _without_amx(monkeypatch)
    for q, w, x, y in _per_row_cases(weight_bits=8):
        assert q.vnni is not None and q.u7 is None and q.few_rows is None
        codes, scale, zero = row_codes(x, bits=8)
        tolerance = float(scale.max() * w.abs().sum(1).max() * q.weight_scale.max()) + 1e-4
        assert float((y - _exact_products(q, w, codes, scale, zero)).abs().max()) < tolerance
        # the codes as the kernel computes them in float32: the same sums, up to their conversion to float32
        codes, scale, zero = _float32_row_codes(x)
        exact = _exact_products(q, w, codes, scale, zero)
        bound = 2 ** -22 * (codes @ w.abs().T + zero * w.abs().sum(1)) * scale * q.weight_scale.double()
        assert bool(((y - exact).abs() <= bound + 1e-6 * (1 + exact.abs())).all())
        if len(x) == 300:
            with torch.no_grad():
                alone = torch.cat([q(x[i:i + 1]) for i in range(20)])
                threads = torch.get_num_threads()
                try:
                    torch.set_num_threads(1)
                    one_thread = q(x)
                finally:
                    torch.set_num_threads(threads)
                assert torch.equal(alone, q(x)[:20]) and torch.equal(one_thread, q(x))
    with pytest.raises(RuntimeError, match="x must be fp32"):
        torch.ops.bertforge.vnni_linear(torch.ones(2, 1536, dtype=torch.float64), *q.vnni, q.weight_scale, None, 384,
                                        False)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.bertforge.vnni_linear(torch.ones(2, 1532), *q.vnni, q.weight_scale, None, 384, False)
    # where they do not run: switched off for a side-by-side run
    layer = nn.Linear(32, 8)
    with bertforge.infer.transforms.on_onednn():
        assert Int8Linear(layer, weight_bits=8).vnni is None and Int8Linear(layer, weight_bits=8).weight is not None
    assert Int8Linear(layer, weight_bits=8).vnni is not None  # the switch restored
    assert q.weight is None and q.vnni_max_rows is None  # without AMX no second copy of the weight for oneDNN


@VNNI_SKIP
def test_with_amx_the_small_products_run_on_the_vnni_kernels_and_the_large_on_onednn(monkeypatch):
    """With AMX, oneDNN's int8 tiles win at large products, the VNNI kernels at small ones: a product of at most
    AMX_VNNI_MAX_MACS multiply-adds gives what the VNNI kernels give, a larger one what oneDNN's product gives."""
    torch.manual_seed(0)
    layer = nn.Linear(384, 1536)
    _without_amx(monkeypatch)
    on_vnni = Int8Linear(layer, weight_bits=8)
    on_onednn = _onednn_only(layer, 8)
    monkeypatch.setattr(bertforge.cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni", "amx_int8"}))
    q = Int8Linear(layer, weight_bits=8)
    assert q.vnni is not None and q.weight is not None  # both copies
    most = bertforge.infer.transforms.AMX_VNNI_MAX_MACS // (384 * 1536)
    assert q.vnni_max_rows == most == 33
    with torch.no_grad():
        for rows in (1, most):  # (one row's codes are the same per row and per tensor: only the sums' order differs)
            x = torch.randn(rows, 384) * 2
            assert torch.equal(q(x), on_vnni(x)) and (rows == 1 or not torch.equal(q(x), on_onednn(x)))
        for shape in ((most + 1, 384), (4, 60, 384)):
            x = torch.randn(shape) * 2
            assert torch.equal(q(x), on_onednn(x)) and not torch.equal(q(x), on_vnni(x))


def test_int8_products_run_on_few_row_counts_with_the_same_results(monkeypatch):
    """oneDNN builds kernels for every new row count, and each batch of texts brings one: the product runs on the rows
    rounded up as a packed batch's are (`linear.packed_rows`), and what comes back is the exact product of the
    quantized operands for the rows asked, in their shape."""
    bits = bertforge.cpu.int8_weight_bits()
    if bits is None or not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    torch.manual_seed(0)
    layer = nn.Linear(32, 24)
    q = _onednn_only(layer, bits)  # at every row count (the other paths: the tests above)
    seen = []
    product = torch.ops.onednn.qlinear_pointwise

    def recording(codes, *args):
        seen.append(codes.numel() // codes.shape[-1])  # its rows, whatever its leading shape
        return product(codes, *args)

    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise", recording)
    top = 2 ** (bits - 1) - 1
    w = (layer.weight.detach().double() / q.weight_scale.double()[:, None]).round().clamp(-top, top)
    for batch, length in [(1, 1), (3, 7), (5, 9), (43, 31), (64, 33), (2, 300)]:
        x = torch.randn(batch, length, 32) * 2
        with torch.no_grad():
            y = q(x)
        assert y.shape == (batch, length, 24)
        codes, scale, zero = activation_codes(x.reshape(-1, 32))
        exact = ((codes - zero) @ w.T) * scale * q.weight_scale.double() + layer.bias.detach().double()
        assert float((y.reshape(-1, 24).double() - exact).abs().max()) < 1e-3 * float(exact.abs().max())
    assert seen == [8, 24, 48, 1344, 2112, 608]  # 1, 21, 45, 1,333, 2,112 (already round) and 600 rows asked
    counts = set()
    for rows in range(1, 8193, 7):  # 1,171 row counts up to 8,192 (a batch's token budget) ask for at most 192 kernels
        seen.clear()
        with torch.no_grad():
            q(torch.randn(rows, 32))
        counts.update(seen)
    assert len(counts) <= 192
