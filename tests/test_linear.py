"""bertforge.linear: the encoder's Linear, its fp32 CPU products on oneDNN where MKL runs slower code. The oneDNN
path is forced on whatever CPU runs the suite and checked against nn.Linear, forward and backward; the choice of
path is checked by CPU vendor and flags and by the environment override."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from bertforge import cpu, kernels, linear
from bertforge.errors import BertforgeError
from bertforge.linear import Linear

pytestmark = pytest.mark.skipif(not linear.has_onednn_linear(),
                                reason="this torch build has no oneDNN linear operator: Linear is nn.Linear")


@pytest.fixture
def onednn(monkeypatch):
    """The oneDNN path on, whatever this CPU is; the cached choice cleared before and after."""
    linear.fp32_on_onednn.cache_clear()
    monkeypatch.setenv(linear.ENV, "onednn")
    yield
    linear.fp32_on_onednn.cache_clear()


def _pair(n_in: int, n_out: int, bias: bool = True) -> tuple[Linear, nn.Linear]:
    torch.manual_seed(0)
    ours = Linear(n_in, n_out, bias=bias)
    ref = nn.Linear(n_in, n_out, bias=bias)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _backward_both(ours, ref, x):
    x_ours, x_ref = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    y_ours, y_ref = ours(x_ours), ref(x_ref)
    grad = torch.randn_like(y_ref)
    y_ours.backward(grad)
    y_ref.backward(grad)
    return (y_ours, y_ref), (x_ours.grad, x_ref.grad)


@pytest.mark.parametrize("shape", [(4, 27, 96), (70, 96), (2, 3, 5, 96)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "no-kernels"])
def test_outputs_and_gradients_match_nn_linear(onednn, monkeypatch, shape, bias, with_kernels):
    assert linear.fp32_on_onednn()
    if with_kernels and not kernels.available():
        pytest.skip("bertforge's CPU kernels do not load here: the weight's gradient transposes with torch's copy")
    if not with_kernels:
        monkeypatch.setattr(kernels, "available", lambda: False)
    ours, ref = _pair(96, 160, bias)
    calls, transposed = [], []
    product, transpose = linear._product, linear._transposed
    monkeypatch.setattr(linear, "_product", lambda *a: calls.append(1) or product(*a))
    monkeypatch.setattr(linear, "_transposed", lambda g: transposed.append(g.shape) or transpose(g))
    (y_ours, y_ref), (dx_ours, dx_ref) = _backward_both(ours, ref, torch.randn(*shape))
    assert len(calls) == 3  # forward, the input's gradient, the weight's: all on oneDNN
    assert transposed == [(torch.Size(shape).numel() // 96, 160)]  # the output's gradient, once, for dW and the bias
    assert y_ours.shape == y_ref.shape and dx_ours.shape == dx_ref.shape
    torch.testing.assert_close(y_ours, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_ours, dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-4)
    assert ours.weight.grad.is_contiguous()
    if bias:
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("int8_kernels")
@pytest.mark.parametrize(("rows", "columns"), [(1, 1), (16, 16), (37, 45), (896, 384), (70, 1537)])
def test_the_transpose_kernel_gives_the_transpose_and_the_column_sums(rows, columns):
    """kernels/transpose.h on this process's build (tests/test_kernels.py runs this file's kernel test on the AVX2
    build too): every value moved exactly, the sums within four times torch's own error of exact ones, where rows and
    columns are and are not whole vectors (one thread against two: tests/test_kernels.py, with the other kernels)."""
    g = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows * columns))
    g_t, sums = torch.ops.bertforge.transpose_sum(g)
    assert g_t.shape == (columns, rows) and g_t.is_contiguous() and torch.equal(g_t, g.t())
    exact = g.double().sum(0)
    bound = max(1e-6, 4 * (g.sum(0).double() - exact).abs().max().item())
    assert sums.dtype == torch.float32 and (sums.double() - exact).abs().max().item() <= bound
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.bertforge.transpose_sum(g.double())


def test_a_non_contiguous_input_and_a_frozen_weight(onednn):
    ours, ref = _pair(48, 32)
    ours.weight.requires_grad_(False)
    ref.weight.requires_grad_(False)
    x = torch.randn(48, 5, 7).permute(1, 2, 0)  # (5, 7, 48), strided
    (y_ours, y_ref), (dx_ours, dx_ref) = _backward_both(ours, ref, x)
    torch.testing.assert_close(y_ours, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_ours, dx_ref, rtol=1e-5, atol=1e-5)
    assert ours.weight.grad is None


def test_onednn_is_handed_rows_it_reads_fast(onednn, monkeypatch):
    """Every operand handed to oneDNN is contiguous or a contiguous matrix transposed: a strided input (here a
    batch's first column, as a pooler reads [CLS]) is copied once, since oneDNN takes other strides at a crawl
    (the weight gradient over 32 [CLS] rows of MiniLM's width, 64 ms against 0.07 copied on a Zen 4). The results
    are nn.Linear's."""
    handed, product = [], linear._product
    monkeypatch.setattr(linear, "_product", lambda x, w, b: handed.extend((x, w)) or product(x, w, b))
    ours, ref = _pair(48, 32)
    batches = [torch.randn(6, 9, 48, generator=torch.Generator().manual_seed(1)).requires_grad_() for _ in range(2)]
    grad = torch.randn(6, 32)
    for layer, batch in zip((ours, ref), batches, strict=True):
        layer(batch[:, 0]).backward(grad)  # (6, 48), rows 9 x 48 floats apart
    torch.testing.assert_close(batches[0].grad, batches[1].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    assert len(handed) == 6  # forward, the input's gradient, the weight's
    assert all(t.is_contiguous() or t.t().is_contiguous() for t in handed)


@pytest.mark.parametrize("shape", [(0, 32), (2, 0, 32)])
def test_an_empty_input_gives_empty_outputs_and_zero_gradients(onednn, shape):
    """oneDNN refuses a product without rows; a batch with no masked positions gives the head one."""
    ours, ref = _pair(32, 16)
    (y_ours, y_ref), (dx_ours, dx_ref) = _backward_both(ours, ref, torch.randn(*shape))
    assert y_ours.shape == y_ref.shape == (*shape[:-1], 16) and dx_ours.shape == dx_ref.shape
    assert not ours.weight.grad.any() and not ours.bias.grad.any()


def test_bf16_autocast_bf16_weights_and_tracing_take_torch_path(onednn, monkeypatch):
    ours, ref = _pair(32, 16)
    monkeypatch.setattr(linear, "_OneDnnLinear", None)  # any use of the oneDNN path would fail
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ours(torch.randn(3, 32)).dtype == torch.bfloat16
    traced = torch.jit.trace(ours, torch.randn(3, 32), check_trace=False)  # as the ONNX export traces: torch ops
    x = torch.randn(5, 32)
    torch.testing.assert_close(traced(x), ref(x))
    assert ours.to(torch.bfloat16)(torch.randn(3, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def _train_both_paths(monkeypatch, build, loss_of) -> tuple[list[dict], set]:
    """The state dicts after 3 AdamW steps of `build()` on `loss_of(model)`, on the oneDNN path and on torch's;
    the shapes of the weights the oneDNN path multiplied forward."""
    weights, shapes = [], set()
    product = linear._product
    monkeypatch.setattr(linear, "_product", lambda x, w, b: shapes.add(tuple(w.shape)) or product(x, w, b))
    for path in ("onednn", "mkl"):
        monkeypatch.setenv(linear.ENV, path)
        linear.fp32_on_onednn.cache_clear()
        torch.manual_seed(1)
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            loss_of(model).backward()
            opt.step()
            opt.zero_grad()
        weights.append(model.state_dict())
    assert any(isinstance(m, Linear) for m in model.modules())
    return weights, shapes


CONFIG = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
              max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.mark.parametrize("head", ["classifier", "masked-lm", "sampled-softmax"])
def test_a_model_trains_the_same_on_either_path(onednn, monkeypatch, head):
    """A few optimizer steps of a small model on each path end within fp32 rounding of each other: the encoder,
    a classifier, the masked-LM head's product with the tied word embeddings, and its sampled softmax's."""
    from bertforge.config import BertConfig
    from bertforge.models import BertForPreTraining, BertForSequenceClassification

    ids = torch.randint(5, 100, (8, 12), generator=torch.Generator().manual_seed(3))
    labels = torch.where(torch.rand(8, 12, generator=torch.Generator().manual_seed(4)) < 0.3, ids, -100)
    if head == "classifier":
        weights, shapes = _train_both_paths(monkeypatch, lambda: BertForSequenceClassification(BertConfig(**CONFIG)),
                                            lambda m: m(input_ids=ids, labels=ids[:, 0] % 2).loss)
        assert {(96, 32), (48, 32), (32, 48), (32, 32)} <= shapes  # qkv, intermediate, output, attention out
    else:
        candidates = (torch.arange(0, 100, 3), torch.zeros(100)) if head == "sampled-softmax" else None
        weights, shapes = _train_both_paths(monkeypatch, lambda: BertForPreTraining(BertConfig(**CONFIG)),
                                            lambda m: m(input_ids=ids, mlm_labels=labels, nsp_labels=ids[:, 0] % 2,
                                                        mlm_candidates=candidates).loss)
        # the tied vocabulary product (100 words), or the sampled one (34 candidates padded to 64)
        assert ((64, 32) if candidates else (100, 32)) in shapes
    for name, w in weights[0].items():
        torch.testing.assert_close(w, weights[1][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(("vendor", "flags", "env", "expected"), [
    ("AuthenticAMD", {"avx512f", "avx2"}, "", True),
    ("AuthenticAMD", {"avx2"}, "", False),
    ("GenuineIntel", {"avx512f", "avx2", "amx_bf16"}, "", False),
    ("", set(), "", False),
    ("GenuineIntel", {"avx512f"}, "onednn", True),
    ("AuthenticAMD", {"avx512f"}, "mkl", False),
    ("AuthenticAMD", {"avx512f"}, " MKL ", False),
])
def test_the_path_is_chosen_by_cpu_and_environment(monkeypatch, vendor, flags, env, expected):
    monkeypatch.setattr(cpu, "vendor", lambda: vendor)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv(linear.ENV, env)
    linear.fp32_on_onednn.cache_clear()
    try:
        assert linear.fp32_on_onednn() is expected
    finally:
        linear.fp32_on_onednn.cache_clear()


def test_an_unknown_override_is_refused(monkeypatch):
    monkeypatch.setenv(linear.ENV, "fast")
    linear.fp32_on_onednn.cache_clear()
    try:
        with pytest.raises(BertforgeError, match="BERTFORGE_FP32_PRODUCTS='fast' is not a choice: set it to onednn "
                                                 "or mkl, or unset it to choose by the CPU"):
            linear.fp32_on_onednn()
    finally:
        linear.fp32_on_onednn.cache_clear()


@pytest.mark.parametrize(("text", "expected"), [
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n", "AuthenticAMD"),
    ("processor\t: 0\nvendor_id : GenuineIntel\n", "GenuineIntel"),
    ("processor\t: 0\nmodel name\t: some ARM core\n", ""),
])
def test_the_vendor_is_read_from_cpuinfo(monkeypatch, text, expected):
    monkeypatch.setattr(cpu, "open", lambda *a, **k: io.StringIO(text), raising=False)
    cpu.cpuinfo_field.cache_clear()
    try:
        assert cpu.vendor() == expected
    finally:
        cpu.cpuinfo_field.cache_clear()
