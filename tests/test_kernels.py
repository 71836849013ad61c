"""bertforge's CPU kernels for int8 inference (bertforge/kernels): each against PyTorch's operators doing the same
work, the int8 encoder built on them against the layers run as they are, and how a machine without them is told.

The kernel tests run on the build this process loads (`kernels.isa()`: AVX-512 on an AVX-512 CPU), and again in a
child process on the AVX2 build, where the CPU has AVX2 + FMA (`test_the_kernel_tests_pass_on_the_avx2_build`): one
build's operators per process, as both register `torch.ops.bertforge`."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from infer_support import activation_codes, at_threads

import bertforge.cpu
import bertforge.infer.fused
import bertforge.infer.transforms
from bertforge import BertConfig, kernels
from bertforge.encoder import BertEncoder, attention_mask_for_sdpa
from bertforge.infer import EngineOptions, FusedEncoder, quantize_int8
from bertforge.infer.fused import _fused_layer
from bertforge.infer.transforms import _has_onednn_ops, prepare
from bertforge.models import BertForSequenceClassification

# built by the first test that needs them, not when the tests are collected; skipped where they cannot be
needs_kernels = pytest.mark.usefixtures("int8_kernels")


def sdpa_reference(qkv: torch.Tensor, heads: int, mask: torch.Tensor | None, positions: torch.Tensor | None):
    """What the attention kernel computes, with PyTorch's operators: (B, P, H), fp32."""
    B, T, three_h = qkv.shape
    D = three_h // 3 // heads
    q, k, v = qkv.float().view(B, T, 3, heads, D).permute(2, 0, 3, 1, 4).unbind(0)
    if positions is not None:
        q = q.gather(2, positions[:, None, :, None].expand(-1, heads, -1, D))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None, None, :])
    return y.transpose(1, 2).reshape(B, q.shape[2], heads * D)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "T", "heads", "D"), [(3, 1, 2, 16), (4, 27, 12, 32), (2, 33, 3, 48), (2, 130, 4, 64),
                                                   (1, 27, 12, 32), (1, 9, 3, 16)])
def test_attention_kernel_matches_sdpa(dtype, B, T, heads, D):
    """Every query, only some positions ([CLS] alone, or any), with and without padding (of different lengths,
    the first sequence unpadded); the range it gives is its output's. One sequence on two threads shares its heads
    out (3 heads: groups of 1 and 2)."""
    torch.manual_seed(T)
    qkv = (torch.randn(B, T, 3 * heads * D) * 2).to(dtype)
    lengths = torch.randint(1, T + 1, (B,))
    lengths[0] = T
    padding = torch.arange(T)[None, :] < lengths[:, None]
    for mask in (None, padding):
        for positions in (None, torch.zeros(B, 1, dtype=torch.long), torch.randint(0, T, (B, 5))):
            out, bounds = torch.ops.bertforge.attention(qkv, heads, mask, positions)
            expected = sdpa_reference(qkv, heads, mask, positions)
            assert out.dtype == torch.float32 and out.shape == expected.shape
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
            assert bounds.tolist() == [out.min().item(), out.max().item()]


@needs_kernels
def test_attention_kernel_takes_scores_far_apart():
    """Scores hundreds apart, so that softmax's exponent goes far below -87, where the kernel clamps it (AVX2 builds
    its 2^n in the exponent bits, which must not go below the least normal exponent): still SDPA's output."""
    torch.manual_seed(0)
    qkv = torch.randn(3, 40, 3 * 2 * 16)
    qkv[..., :32] *= 60  # queries: scores of standard deviation 60
    out, _ = torch.ops.bertforge.attention(qkv, 2, None, None)
    expected = sdpa_reference(qkv, 2, None, None)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@needs_kernels
def test_the_loaded_build_is_the_one_chosen():
    """The operators this process holds are those of the build `isa()` chose: 16 floats a vector on AVX-512, 8 on
    AVX2 (the child process of test_the_kernel_tests_pass_on_the_avx2_build)."""
    assert torch.ops.bertforge.lanes() == {"avx512": 16, "avx2": 8}[kernels.isa()]


@needs_kernels
def test_the_kernels_run_on_torchs_threads_with_the_same_results():
    """The kernels' loops share out their rows (sequences, values, column blocks) over torch's intra-op threads,
    which needs a build with OpenMP: without it each ran on the calling thread alone, whatever torch's thread count.
    Their outputs on two threads are those on one, bit for bit."""
    torch.manual_seed(0)
    ops = torch.ops.bertforge
    qkv, x, residual = torch.randn(6, 27, 3 * 4 * 16), torch.randn(300, 64), torch.randn(300, 64)
    one_text = torch.randn(1, 27, 3 * 5 * 16)  # fewer sequences than threads: its heads shared out (2 and 3)
    weight, bias = torch.randn(64), torch.randn(64)
    big = torch.randn(200_000)

    def outputs() -> list[torch.Tensor]:
        return [*ops.attention(qkv, 4, None, None), *ops.attention(one_text, 5, None, None),
                *ops.add_layer_norm(x, residual, weight, bias, 1e-12),
                ops.value_range(big), ops.quantize_u8(big, 0.02, 128), ops.keep_mask(200_000, 0.1, 7),
                ops.apply_keep_mask(big, 0.1, 7), *ops.transpose_sum(torch.cat([x, residual], 1)[:, :125])]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = outputs()
        assert ops.parallel_threads() == 1
        torch.set_num_threads(2)
        assert ops.parallel_threads() == 2
        two = outputs()
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)

# the int8 engine's test that runs on the kernels (the rest of test_infer_int8.py runs on PyTorch's operators),
# dropout's masks from the kernel against torch's operators, the transpose, training's attention and clipping's norm,
# fp32's few-row products
ENGINE_TESTS = (Path(__file__).with_name("test_fp32_panels.py").as_posix(),
                Path(__file__).with_name("test_fp32_encoder.py").as_posix(),
                Path(__file__).with_name("test_infer_int8.py").as_posix() + "::test_int8_stays_close_to_fp32",
                Path(__file__).with_name("test_dropout.py").as_posix()
                + "::test_the_kernel_gives_the_torch_masks_bit_for_bit",
                Path(__file__).with_name("test_dropout.py").as_posix()
                + "::test_the_kernel_applies_the_mask_as_torchs_operators_do",
                Path(__file__).with_name("test_linear.py").as_posix()
                + "::test_the_transpose_kernel_gives_the_transpose_and_the_column_sums",
                Path(__file__).with_name("test_attention_train.py").as_posix(),
                Path(__file__).with_name("test_add_norm.py").as_posix(),
                Path(__file__).with_name("test_gelu.py").as_posix()
                + "::test_the_gelu_with_its_bias_and_the_bias_gradient_match_float64",
                Path(__file__).with_name("test_optim.py").as_posix())


@pytest.mark.slow  # a child pytest and, the first time, the AVX2 build: 12-25 s
def test_the_kernel_tests_pass_on_the_avx2_build(tmp_path):
    """The AVX2 build (what an AVX2-only CPU, such as the AMD EPYC, runs) forced on this CPU with
    BERTFORGE_KERNELS=avx2: this file's tests, the int8 engine's and dropout's masks, in a child process, all passed,
    none skipped."""
    if kernels.isa() == "avx2":
        pytest.skip("this process runs the AVX2 build already: the tests above are its tests")
    if not {"avx2", "fma"} <= bertforge.cpu.cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA to run the AVX2 build on")
    report = tmp_path / "report.xml"
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
         "-k", "not avx2_build and not the_wheel", __file__, *ENGINE_TESTS],  # itself and pyproject's check aside
        cwd=Path(__file__).parents[1], env={**os.environ, "BERTFORGE_KERNELS": "avx2"}, capture_output=True,
        text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    suite = ET.parse(report).getroot().find("testsuite")
    assert int(suite.get("skipped")) == 0, child.stdout[-4000:]
    assert int(suite.get("tests")) >= 20  # this file's kernel tests and their cases, and the engine's


@needs_kernels
def test_attention_kernel_gives_zeros_where_no_key_may_be_attended():
    """A sequence of padding only: SDPA gives NaN there, the kernel zeros, and its neighbours are untouched."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3 * 32)
    mask = torch.tensor([[True] * 5, [False] * 5])
    out, bounds = torch.ops.bertforge.attention(qkv, 2, mask, None)
    assert torch.equal(out[1], torch.zeros(5, 32))
    torch.testing.assert_close(out[0], sdpa_reference(qkv[:1], 2, None, None)[0], atol=2e-5, rtol=1e-5)
    assert bounds[0] <= 0 <= bounds[1]


@needs_kernels
def test_kernels_refuse_shapes_they_do_not_handle():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.bertforge.attention(torch.randn(2, 5, 3 * 2 * 8), 2, None, None)  # heads of 8
    with pytest.raises(RuntimeError, match="within the sequence"):
        torch.ops.bertforge.attention(torch.randn(2, 5, 96), 2, None, torch.full((2, 1), 5))
    with pytest.raises(RuntimeError, match="same shape"):
        torch.ops.bertforge.add_layer_norm(torch.randn(3, 32), torch.randn(2, 32), torch.ones(32), torch.zeros(32),
                                           1e-12)


@needs_kernels
@pytest.mark.parametrize("shape", [(5, 7, 384), (1, 1, 16), (300, 48)])
def test_layer_norm_kernels_match_torch(shape):
    """add_layer_norm (post-LN) and residual_layer_norm (pre-LN: the sum kept too, or x alone normalized) against
    F.layer_norm; the range each gives is its output's."""
    torch.manual_seed(len(shape))
    x, residual = torch.randn(shape) * 3, torch.randn(shape)
    weight, bias = torch.randn(shape[-1]), torch.randn(shape[-1])
    expected = F.layer_norm(x + residual, shape[-1:], weight, bias, 1e-12)
    out, bounds = torch.ops.bertforge.add_layer_norm(x, residual, weight, bias, 1e-12)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert bounds.tolist() == [out.min().item(), out.max().item()]
    total, out, bounds = torch.ops.bertforge.residual_layer_norm(x, residual, weight, bias, 1e-12)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert bounds.tolist() == [out.min().item(), out.max().item()]
    same, out, _ = torch.ops.bertforge.residual_layer_norm(x, None, weight, bias, 1e-12)
    assert torch.equal(same, x)
    torch.testing.assert_close(out, F.layer_norm(x, shape[-1:], weight, bias, 1e-12), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_value_range_and_quantize_u8_give_int8_linears_codes():
    """The range and the u8 codes of an fp32 tensor as Int8Linear takes them from its kernels: the range exactly
    torch's, the codes worked out by hand (infer_support's `activation_codes`), a code off by one at most where a
    value sits on a rounding boundary; any length, a partial vector at the end included."""
    torch.manual_seed(0)
    for x in (torch.randn(64, 37, 48) * 3 - 1, torch.rand(300, 20) + 2, -torch.rand(10, 9), torch.randn(7),
              torch.zeros(4, 5)):
        bounds = torch.ops.bertforge.value_range(x)
        assert bounds.tolist() == [x.min().item(), x.max().item()]
        expected, scale, zero = activation_codes(x)
        codes = torch.ops.bertforge.quantize_u8(x, scale, zero)
        assert codes.dtype == torch.uint8 and codes.shape == x.shape
        off = (codes.double() - expected).abs()
        assert off.max() <= 1 and (off > 0).double().mean() < 1e-3
    with pytest.raises(RuntimeError, match="scale must be positive"):
        torch.ops.bertforge.quantize_u8(torch.ones(3), 0.0, 0)


def classifier(**overrides) -> BertForSequenceClassification:
    torch.manual_seed(0)
    fields = dict(vocab_size=200, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=128,
                  max_position_embeddings=64, num_labels=3)
    config = BertConfig(**{**fields, **overrides})
    return BertForSequenceClassification(config).eval()


def batch(T: int = 19):
    torch.manual_seed(1)
    ids = torch.randint(5, 200, (6, T))
    mask = torch.ones(6, T, dtype=torch.long)
    for row, length in enumerate((T, 3, 11, T - 1, 7, 1)):
        mask[row, length:] = 0
    return ids, mask


@needs_kernels
def test_int8_encoder_runs_on_the_kernels_and_agrees_with_its_layers():
    """quantize_int8 puts a FusedEncoder in place, holding the same int8 layers. Layer by layer it gives what
    those layers give on PyTorch's operators: the same activation ranges, so the same codes, up to a code off by
    one where LayerNorm's rounding moves a value across a step; the whole classifier's logits stay as close."""
    model = quantize_int8(classifier())
    encoder = model.bert.encoder
    assert isinstance(encoder, FusedEncoder) and encoder.layer[0].attention.qkv.bf16_max_positions == 0
    assert all(layer.output.kernels for layer in encoder.layer)
    ids, mask = batch()
    with torch.no_grad():
        x = model.bert.embeddings(ids)
        sdpa_mask = attention_mask_for_sdpa(mask)
        for layer in encoder.layer:
            fused, bounds = _fused_layer(layer, x, sdpa_mask[:, 0, 0, :], None, None)
            plain = layer(x, sdpa_mask)
            torch.testing.assert_close(fused, plain, atol=0.02, rtol=0)
            assert (fused - plain).abs().mean() < 1e-4
            assert bounds.tolist() == [fused.min().item(), fused.max().item()]
            x = plain
        logits = model(ids, attention_mask=mask).logits
        model.bert.encoder = BertEncoder(model.config)
        model.bert.encoder.layer = encoder.layer
        torch.testing.assert_close(logits, model(ids, attention_mask=mask).logits, atol=0.02, rtol=0)


@needs_kernels
@pytest.mark.parametrize("pre_ln", [False, True])
def test_fp32_encoder_runs_on_the_kernels_and_gives_the_models_outputs(pre_ln):
    """`prepare`'s fp32 path (the CPU's default) puts a FusedEncoder in place, the feed-forward's GELU inside its
    first product: on a padded batch the classifier's logits and the encoder's outputs at the real tokens are the
    model's as it runs on PyTorch's operators, to fp32 rounding."""
    if not _has_onednn_ops():
        pytest.skip("fp32 products are packed for oneDNN only where torch has its operators")
    model = classifier(pre_layer_norm=pre_ln)
    reference = copy.deepcopy(model)
    fast = prepare(model, EngineOptions(), torch.device("cpu"))
    assert isinstance(fast.bert.encoder, FusedEncoder)
    assert all(layer.intermediate.activation == "gelu" for layer in fast.bert.encoder.layer)
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=1e-5)
        got = fast.bert(ids, attention_mask=mask).sequence_output[real]
        torch.testing.assert_close(got, reference.bert(ids, attention_mask=mask).sequence_output[real], atol=1e-5,
                                   rtol=1e-5)


@needs_kernels
def test_int8_encoder_runs_longer_batches_on_its_layers(monkeypatch):
    """Past FusedEncoder's longest batch the layers run as they are: the kernels are not called, and the logits
    are those of a plain BertEncoder holding the same layers."""
    model = quantize_int8(classifier())
    fused = model.bert.encoder
    fused.max_positions = 18
    plain = BertEncoder(model.config)
    plain.layer = fused.layer
    ids, mask = batch(T=19)
    calls = []
    monkeypatch.setattr(bertforge.infer.fused, "_fused_layer", lambda *args: calls.append(args))
    with torch.no_grad():
        longer = model(ids, attention_mask=mask).logits
        model.bert.encoder = plain
        assert torch.equal(longer, model(ids, attention_mask=mask).logits)
    assert not calls


@needs_kernels
def test_pre_ln_int8_encoder_runs_on_the_kernels_and_agrees_with_its_layers():
    """Pre-LN layers (bertforge's budget recipe makes them) on the kernels: the classifier's logits as close to the
    same int8 layers run as they are, the final LayerNorm included, as the post-LN encoder's are; [CLS] only in
    the last layer (classification) and every position (the encoder's output) alike."""
    model = quantize_int8(classifier(pre_layer_norm=True))
    fused = model.bert.encoder
    assert isinstance(fused, FusedEncoder) and fused.final_norm is not None
    plain = BertEncoder(model.config)
    plain.layer, plain.final_norm = fused.layer, fused.final_norm
    ids, mask = batch()
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits, model.bert(ids, attention_mask=mask).sequence_output
        model.bert.encoder = plain
        expected = model(ids, attention_mask=mask).logits, model.bert(ids, attention_mask=mask).sequence_output
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=0.02, rtol=0)
        assert (a - b).abs().mean() < 1e-4  # seen: 6e-8 and below


@needs_kernels
@pytest.mark.parametrize("pre_ln", [False, True])
def test_fused_models_take_their_embeddings_from_the_kernel(pre_ln):
    """Where an encoder is fused, its model's embeddings are too (`FusedEmbeddings`): in eval mode the kernel's rows
    are the module's (three rows summed in torch's order, then LayerNorm) to fp32 rounding, with and without type
    ids; the tables stay the module's own (the masked-LM decoder is tied to the word embeddings); training runs the
    module as it is; ids outside the tables are refused in one line."""
    model = quantize_int8(classifier(pre_layer_norm=pre_ln))
    fused = model.bert.embeddings
    assert isinstance(fused, bertforge.infer.fused.FusedEmbeddings)
    plain = fused.plain
    assert fused.word_embeddings is plain.word_embeddings and fused.LayerNorm is plain.LayerNorm
    with torch.no_grad():
        plain.LayerNorm.weight.add_(torch.randn(64) * 0.1)
        plain.LayerNorm.bias.add_(torch.randn(64) * 0.1)
    ids, _ = batch()
    types = (torch.arange(ids.shape[1]) >= 9).long().expand_as(ids)
    with torch.no_grad():
        for t in (None, types):
            got = fused(ids, t)
            torch.testing.assert_close(got, plain(ids, t), atol=2e-6, rtol=1e-6)
        assert not torch.equal(fused(ids, types), fused(ids, None))
        fused.train()
        torch.manual_seed(3)
        dropped = fused(ids, types)
        torch.manual_seed(3)
        assert torch.equal(dropped, plain(ids, types))  # the module itself, its dropout included
        fused.eval()
        with pytest.raises(RuntimeError, match="ids must lie within the vocabulary"):
            fused(torch.tensor([[1, 200]]))
        with pytest.raises(RuntimeError, match="type ids must lie within"):
            fused(ids, types * 2)
        with pytest.raises(RuntimeError, match="longer than the position embeddings"):
            fused(torch.ones(1, 65, dtype=torch.long))


@needs_kernels
@pytest.mark.parametrize("pre_ln", [False, True])
def test_a_7_bit_encoder_runs_a_sequence_at_a_time_with_its_operators_bits(monkeypatch, pre_ln):
    """Where int8 weights get 7 bits (CPUs without int8 dot products: the u7 kernels, in both builds), the encoder runs
    a sequence at a time too (the kernels' int8_encoder on u7 products): the same bits as its layers operator by
    operator on the u7 kernels, the GELU inside the product either way, every position, [CLS] alone and some
    positions out of order (the last layer's queries computed at the answered rows only)."""
    if not _has_onednn_ops():
        pytest.skip("Int8Linear runs where torch has oneDNN's operators")
    monkeypatch.setattr(bertforge.cpu, "int8_weight_bits", lambda: 7)
    model = quantize_int8(classifier(pre_layer_norm=pre_ln, intermediate_size=136))
    encoder = model.bert.encoder
    assert encoder.sequence_weights is not None and encoder.sequence_u7
    assert encoder.layer[0].intermediate.u7 is not None and encoder.layer[0].intermediate.activation == "gelu"
    ids, mask = batch(T=23)
    holed = mask.clone()
    holed[:, 1] = 0  # keys after a gap: every row of the sequence runs, not just the first run of keys
    with torch.no_grad():
        some = torch.tensor([[5, 0, 2, 5]]).expand(ids.shape[0], -1)

        def outputs():  # [CLS] alone (its padding's rows left out where the keys come first), every position
            return (model(ids, attention_mask=mask).logits, model(ids, attention_mask=holed).logits,
                    model.bert(ids, attention_mask=mask).sequence_output,
                    model.bert(ids, attention_mask=mask, positions=some).sequence_output)
        got = outputs()
        weights, encoder.sequence_weights = encoder.sequence_weights, None
        expected = outputs()
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    # one text on one thread or two: on the operator either way (two threads share its work out where it is large
    # enough, tests/test_int8_encoder.py); post-LN's operator-by-operator path is the one that calls _fused_layer
    encoder.sequence_weights = weights
    calls = []
    fused_layer = bertforge.infer.fused._fused_layer
    monkeypatch.setattr(bertforge.infer.fused, "_fused_layer", lambda *a: calls.append(1) or fused_layer(*a))
    threads = torch.get_num_threads()
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            with torch.no_grad():
                model(ids[:1, :10], attention_mask=mask[:1, :10])
        assert not calls
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="not u7_pack's panels"):
        torch.ops.bertforge.int8_encoder(torch.zeros(1, 2, 64), None, None, [weights[4], *weights[1:]], 2,
                                         encoder.sequence_eps, pre_ln, True)


@needs_kernels
def test_a_7_bit_lone_sequence_shares_its_work_out_with_the_same_bits(monkeypatch):
    """On the u7 kernels too (7-bit weights, CPUs without int8 dot products), a batch of fewer sequences than threads
    shares each one's products and attention out over them (tests/test_int8_encoder.py for the VNNI kernels): the same
    bits at two and four threads as at one, pre-LN, [CLS] alone and every position."""
    if not _has_onednn_ops():
        pytest.skip("Int8Linear runs where torch has oneDNN's operators")
    monkeypatch.setattr(bertforge.cpu, "int8_weight_bits", lambda: 7)
    model = quantize_int8(classifier(hidden_size=256, num_attention_heads=4, intermediate_size=520,
                                     max_position_embeddings=128, pre_layer_norm=True))
    assert model.bert.encoder.sequence_u7
    ids = torch.randint(5, 200, (1, 100), generator=torch.Generator().manual_seed(2))

    def outputs():
        assert torch.ops.bertforge.int8_encoder_shares(1, 100, 256, 520, True) == (torch.get_num_threads() > 1)
        return model(ids).logits, model.bert(ids).sequence_output
    got = at_threads((1, 2, 4), outputs)
    for n in (2, 4):
        for a, b in zip(got[n], got[1], strict=True):
            assert torch.equal(a, b), n


@needs_kernels
def test_the_encoder_runs_a_sequence_at_a_time_on_the_kernels_its_products_run_on():
    """The int8_encoder operator (the whole encoder a sequence at a time, tests/test_int8_encoder.py) runs on the
    VNNI kernels, or on the u7 kernels where the weights are 7-bit (CPUs without int8 dot products); a build without
    VNNI refuses the VNNI products in one line, and an encoder whose products are on neither runs operator by
    operator. Either way its logits are those of the same layers run as they are."""
    model = quantize_int8(classifier())
    encoder = model.bert.encoder
    ids, mask = batch()
    if torch.ops.bertforge.has_vnni() and bertforge.infer.transforms.vnni_products():
        assert encoder.sequence_weights is not None  # 64 wide: a sequence at a time with AMX or without
        return
    if not torch.ops.bertforge.has_vnni():
        with pytest.raises(RuntimeError, match="has no AVX-512 VNNI .* its products run on the u7 kernels"):
            torch.ops.bertforge.int8_encoder(torch.zeros(1, 2, 64), None, None, [torch.zeros(1)] * 20, 2,
                                             [1e-12] * 2, False)
    on_u7 = encoder.layer[0].attention.qkv.u7 is not None
    assert (encoder.sequence_weights is not None) == on_u7
    assert encoder.sequence_u7 == on_u7
    plain = BertEncoder(model.config)
    plain.layer = encoder.layer
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        model.bert.encoder = plain
        torch.testing.assert_close(logits, model(ids, attention_mask=mask).logits, atol=0.02, rtol=0)


def test_int8_encoder_is_fused_only_where_it_can_be(monkeypatch):
    """Heads of a size the kernels do not take (8), a feed-forward activation other than GELU (not inside the
    product) and a machine without the kernels keep the encoder as it is."""
    if bertforge.cpu.int8_weight_bits() is None or not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    if kernels.available():
        assert isinstance(quantize_int8(classifier()).bert.encoder, FusedEncoder)
        assert type(quantize_int8(classifier(num_attention_heads=8)).bert.encoder) is BertEncoder
        assert type(quantize_int8(classifier(hidden_act="relu")).bert.encoder) is BertEncoder
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert type(quantize_int8(classifier()).bert.encoder) is BertEncoder


@pytest.mark.parametrize(("flags", "asked", "expected"), [
    ({"avx512f", "avx2", "fma"}, None, "avx512"),
    ({"avx512f", "avx2", "fma"}, "1", "avx512"),
    ({"avx512f", "avx2", "fma"}, "avx2", "avx2"),
    ({"avx512f", "avx2", "fma"}, "0", None),
    ({"avx2", "fma"}, None, "avx2"),  # an AMD EPYC before Zen 4
    ({"avx2", "fma"}, "avx512", None),
    ({"avx2", "fma"}, "AVX-2", "avx2"),  # not a choice: the CPU's best (said on stderr by available())
    ({"avx2"}, None, None),  # no FMA
    ({"sse4_2"}, "avx2", None),
])
def test_the_build_follows_the_cpu_and_the_environment(monkeypatch, flags, asked, expected):
    monkeypatch.setattr(bertforge.cpu, "cpu_flags", lambda: frozenset(flags))
    if asked is None:
        monkeypatch.delenv("BERTFORGE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("BERTFORGE_KERNELS", asked)
    assert kernels.isa() == expected


def test_kernels_off_by_environment_or_without_tools(monkeypatch, capsys, tmp_path):
    """BERTFORGE_KERNELS=0 turns them off quietly, and so does a CPU without AVX-512 or AVX2 + FMA; a build the CPU
    cannot run asked for by name, a value that is no choice, a missing compiler or ninja where a build is needed are
    each said in one line on stderr (with what to install), and int8 goes on without them; so is a failed build."""
    build = kernels.available.__wrapped__
    monkeypatch.setenv("BERTFORGE_KERNELS", "0")
    assert build() is False and capsys.readouterr().err == ""
    monkeypatch.setenv("BERTFORGE_KERNELS", "1")
    monkeypatch.setattr(bertforge.cpu, "cpu_flags", lambda: frozenset({"avx2"}))
    assert build() is False and capsys.readouterr().err == ""  # AVX2 without FMA: nothing to say
    monkeypatch.setenv("BERTFORGE_KERNELS", "avx2")
    assert build() is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BERTFORGE_KERNELS=avx2" in err and "lacks fma" in err
    monkeypatch.setenv("BERTFORGE_KERNELS", "yes")
    monkeypatch.setattr(bertforge.cpu, "cpu_flags", lambda: frozenset({"avx512f"}))
    monkeypatch.setattr(kernels, "_loaded", lambda: True)
    assert build() is True
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BERTFORGE_KERNELS=yes is not one of 0, 1, avx512, avx2" in err
    monkeypatch.setenv("BERTFORGE_KERNELS", "1")
    monkeypatch.setattr(kernels, "_loaded", lambda: False)
    monkeypatch.setattr(kernels, "_put_pip_ninja_on_path", lambda: None)
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)  # no finished build: one is needed
    monkeypatch.setattr(kernels.shutil, "which", lambda tool: None if tool == "c++" else "/usr/bin/" + tool)
    assert build() is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt install g++" in err and "pip install ninja" not in err
    monkeypatch.setattr(kernels.shutil, "which", lambda tool: "/usr/bin/" + tool)
    monkeypatch.setattr("torch.utils.cpp_extension.load", mock.Mock(side_effect=RuntimeError("no")))
    assert build() is False
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "building" in err and "did not build (no)" in err


def test_a_build_is_never_reused_on_another_cpu(monkeypatch):
    """The build's name (its cache directory) changes with the ISA it is built for, the CPU's features, torch's
    version and commit and the sources; not with where torch is installed."""
    monkeypatch.setattr(bertforge.cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    one, avx2 = kernels._build_name("avx512"), kernels._build_name("avx2")
    monkeypatch.setattr(bertforge.cpu, "cpu_flags", lambda: frozenset({"avx512f"}))
    other = kernels._build_name("avx512")
    monkeypatch.setattr(torch, "__file__", "/another/.venv/torch/__init__.py")  # the same torch elsewhere: shared
    assert kernels._build_name("avx512") == other
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)  # another build of torch
    commit = kernels._build_name("avx512")
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert len({one, avx2, other, commit, kernels._build_name("avx512")}) == 5
    assert one.startswith("bertforge_cpu_avx512_") and avx2.startswith("bertforge_cpu_avx2_")


def test_a_finished_build_is_loaded_without_ninja_or_a_compiler(monkeypatch, tmp_path):
    """A .so without its marker (maybe a build under way elsewhere) goes through the build, which leaves the marker;
    with it, the .so is loaded as it is, with no ninja or compiler, or, where it fails to load (corrupt), rebuilt."""
    calls, build = [], kernels.available.__wrapped__
    monkeypatch.setattr(kernels, "isa", lambda: "avx2")
    monkeypatch.setattr(kernels, "_loaded", lambda: False)
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda name, **options: calls.append(name))
    monkeypatch.setattr(kernels.shutil, "which", lambda tool: "/usr/bin/" + tool)
    library = tmp_path / "kernels" / kernels._build_name("avx2") / f"{kernels._build_name('avx2')}.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    assert build() is True and len(calls) == 1 and library.exists() and library.with_suffix(".ready").exists()
    assert build() is True and len(calls) == 2 and not library.exists()  # the empty .so did not load: rebuilt
    monkeypatch.setattr(torch.ops, "load_library", calls.append)
    monkeypatch.setattr(kernels.shutil, "which", lambda tool: None)
    assert build() is True and calls[2:] == [str(library)]


def test_every_file_the_build_reads_is_in_its_name(monkeypatch, tmp_path):
    """The build compiles cpu_kernels.cpp, which includes the headers beside it: every one of them is among the files
    hashed into the build's name (`kernels.FILES`), and a change to any of them gives a new name."""
    names = {path.name for path in kernels.FILES}
    assert kernels.SOURCE in kernels.FILES and {"vec.h", "attention.h"} <= names
    for path in kernels.FILES:
        assert set(re.findall(r'#include "([^"]+)"', path.read_text())) <= names, path.name
    before = kernels._build_name("avx2")
    for i, path in enumerate(kernels.FILES):
        changed = tmp_path / path.name
        changed.write_text(path.read_text() + "\n")
        monkeypatch.setattr(kernels, "FILES", (*kernels.FILES[:i], changed, *kernels.FILES[i + 1:]))
        assert kernels._build_name("avx2") != before, path.name
        monkeypatch.undo()


def test_the_wheel_carries_every_file_the_build_reads():
    """pyproject.toml's package data for bertforge.kernels covers each of them: a wheel without vec.h would fail to
    build its kernels on every machine (int8 then runs on PyTorch's operators, slower)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib comes with Python 3.11")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["bertforge.kernels"]
    missing = [path.name for path in kernels.FILES if not any(path.match(pattern) for pattern in patterns)]
    assert not missing, f'pyproject.toml\'s package-data leaves out {missing}: "bertforge.kernels" = ["*.cpp", "*.h"]'


def test_the_ninja_pip_installed_is_found_off_path(monkeypatch):
    """bertforge run as .venv/bin/bertforge, unactivated: the ninja that pip put beside it is not on PATH, and the
    build still finds it."""
    ninja = pytest.importorskip("ninja", reason="ninja comes with bertforge's dependencies")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert kernels.shutil.which("ninja") is None
    kernels._put_pip_ninja_on_path()
    found = kernels.shutil.which("ninja")
    assert found is not None and found.startswith(ninja.BIN_DIR)
