"""Training's attention on bertforge's kernels (kernels/attention_train.h, `bertforge.training_attention`):
outputs and gradients against attention written out in float64 from the definition (dropout's mask from the
reference hash), against the unfused path the model runs without the kernels, where the model takes it, and bad
inputs; packed batches (real tokens only) against padded ones, in the kernels and in a model; bf16 (under autocast)
against fp32 on the same values. Also run on the AVX2 build (tests/test_kernels.py's ENGINE_TESTS)."""

from __future__ import annotations

import pytest
import torch
from support import right_padded

from bertforge import BertConfig, kernels
from bertforge.dropout import draw_key, keep_mask_reference
from bertforge.encoder import BertSelfAttention
from bertforge.models import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification
from bertforge.training_attention import TrainingAttention, TrainingPacking

pytestmark = pytest.mark.usefixtures("int8_kernels")


def reference(qkv: torch.Tensor, heads: int, mask: torch.Tensor | None, p: float, key: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) over the allowed keys, dropout at p with `key`'s mask over the (B, N, T, T)
    probabilities, times v; float64, heads merged into (B, T, H)."""
    B, T, three_h = qkv.shape
    D = three_h // 3 // heads
    q, k, v = qkv.double().view(B, T, 3, heads, D).permute(2, 0, 3, 1, 4).unbind(0)
    scores = q @ k.transpose(-1, -2) / D**0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1)
    if p > 0:
        probs = probs * keep_mask_reference(probs.numel(), p, key).view(probs.shape) / (1 - p)
    return (probs @ v).transpose(1, 2).reshape(B, T, heads * D)


def padded(B: int, T: int) -> torch.Tensor:
    """A (B, T) key mask: the first sequence's last two keys and the last one's last key padding."""
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, max(T - 2, 1):] = False
    mask[-1, max(T - 1, 1):] = False
    return mask


@pytest.mark.parametrize(("B", "T", "heads", "D", "p"), [
    (2, 1, 2, 16, 0.0), (3, 5, 2, 16, 0.0), (2, 17, 3, 32, 0.1), (4, 28, 12, 32, 0.1), (2, 33, 2, 64, 0.5),
    (1, 70, 4, 48, 0.0)])
def test_outputs_and_gradients_follow_the_definition(B, T, heads, D, p):
    """The kernels' output and qkv's gradient against float64 autograd through `reference`, dropout's mask drawn
    from the same key: within fp32 rounding (1e-5 of the values' size)."""
    torch.manual_seed(B * T + heads)
    qkv = torch.randn(B, T, 3 * heads * D, requires_grad=True)
    mask, grad = padded(B, T) if T > 1 else None, torch.randn(B, T, heads * D)
    key = 0x9234_5678_9ABC_DEF0 - (1 << 64) if p > 0 else 0  # an int64 with its top bit set
    out, probs = torch.ops.bertforge.attention_train(qkv.detach(), heads, mask, p, key)
    dqkv = torch.ops.bertforge.attention_train_backward(grad, qkv.detach(), probs, heads, p, key)
    want = reference(qkv, heads, mask, p, key)
    want.backward(grad.double())
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.allclose(dqkv, qkv.grad, rtol=1e-5, atol=1e-5 * qkv.grad.abs().max().item())
    if mask is not None:  # no gradient reaches a padded key or its value
        keys = qkv.grad.shape[-1] // 3
        assert torch.all(dqkv[~mask][:, keys:] == 0)


@pytest.mark.parametrize(("packed", "p"), [(False, 0.0), (False, 0.1), (True, 0.1)])
def test_bf16_is_fp32_on_the_same_values_rounded_once(packed, p):
    """bf16 qkv and gradient: the output and qkv's gradient are the fp32 kernels' on the same values, each rounded to
    bf16 once, bit for bit; the probabilities (kept fp32) are the same bits."""
    torch.manual_seed(3)
    B, T, heads, D = 3, 19, 2, 32
    qkv, grad = torch.randn(B, T, 3 * heads * D).bfloat16(), torch.randn(B, T, heads * D).bfloat16()
    args: tuple = (padded(B, T), p, 77)
    if packed:
        lengths = [19, 12, 5]
        keep = right_padded(lengths, T)
        qkv, grad = qkv[keep], grad[keep]
        args = (None, p, 77, torch.tensor([0, 19, 31, 36]), T)
    out, probs = torch.ops.bertforge.attention_train(qkv, heads, *args[:3], *args[3:])
    out32, probs32 = torch.ops.bertforge.attention_train(qkv.float(), heads, *args[:3], *args[3:])
    assert out.dtype == torch.bfloat16 and probs.dtype == torch.float32
    assert torch.equal(out, out32.bfloat16()) and torch.equal(probs, probs32)
    ops = torch.ops.bertforge
    dqkv = ops.attention_train_backward(grad, qkv, probs, heads, p, 77, *args[3:])
    dqkv32 = ops.attention_train_backward(grad.float(), qkv.float(), probs32, heads, p, 77, *args[3:])
    assert dqkv.dtype == torch.bfloat16 and torch.equal(dqkv, dqkv32.bfloat16())
    assert dqkv.abs().sum() > 0
    with pytest.raises(RuntimeError, match="of qkv's type"):
        ops.attention_train_backward(grad.float(), qkv, probs, heads, p, 77, *args[3:])


def attention_module(heads: int, D: int, p: float) -> BertSelfAttention:
    config = BertConfig(vocab_size=10, hidden_size=heads * D, num_hidden_layers=1, num_attention_heads=heads,
                        intermediate_size=4 * heads * D, attention_probs_dropout_prob=p)
    return BertSelfAttention(config).train()


@pytest.mark.parametrize("masked", [False, True])
def test_a_seed_trains_the_same_on_the_kernels_and_the_unfused_path(monkeypatch, masked):
    """A training forward and backward of the attention module, seeded alike, with the kernels and without them:
    the same outputs and gradients (the layer's input and its weights) up to fp32 rounding: the dropout drops the
    same probabilities."""
    torch.manual_seed(0)
    module, x = attention_module(4, 32, 0.1), torch.randn(3, 21, 128, requires_grad=True)
    mask, grad = padded(3, 21)[:, None, None, :] if masked else None, torch.randn(3, 21, 128)
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(TrainingAttention, "enabled", enabled)
        torch.manual_seed(1)
        y = module(x, mask)
        y.backward(grad)
        results.append((y.detach(), x.grad, module.qkv.weight.grad))
        x.grad, module.qkv.weight.grad, module.qkv.bias.grad = None, None, None
    for fused, unfused in zip(*results, strict=True):
        assert torch.allclose(fused, unfused, rtol=1e-5, atol=1e-5 * unfused.abs().max().item())
    assert not torch.equal(results[0][0], module.train(False)(x, mask))  # dropout did drop


def test_the_model_takes_the_kernels_only_where_they_apply(monkeypatch):
    """fp32 on the CPU, or under bf16 autocast, with a gradient wanted and heads of whole vectors: the kernels;
    inference, fp16 autocast, heads of 24 floats, a query subset, or `enabled` off: the unfused path."""
    calls, apply = [], TrainingAttention.apply
    monkeypatch.setattr(TrainingAttention, "apply", lambda *args: calls.append(args[0].shape) or apply(*args))
    x = torch.randn(2, 9, 64, requires_grad=True)
    attention_module(2, 32, 0.0)(x, None)
    assert len(calls) == 1
    with torch.no_grad():
        attention_module(2, 32, 0.0)(x, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_module(2, 32, 0.0)(x, None).dtype == torch.bfloat16
    assert len(calls) == 2
    with torch.autocast("cpu", dtype=torch.float16):
        attention_module(2, 32, 0.0)(x, None)
    attention_module(2, 32, 0.0)(x, None, positions=torch.zeros(2, 1, dtype=torch.long))
    config = BertConfig(vocab_size=10, hidden_size=48, num_hidden_layers=1, num_attention_heads=2, intermediate_size=96)
    BertSelfAttention(config).train()(torch.randn(2, 9, 48, requires_grad=True), None)
    monkeypatch.setattr(TrainingAttention, "enabled", False)
    attention_module(2, 32, 0.0)(x, None)
    assert len(calls) == 2


def test_a_sequence_with_no_key_to_attend_gets_zeros():
    """Every key padded: zeros out and no gradient (the unfused path gives NaN)."""
    qkv, mask = torch.randn(2, 5, 3 * 32), torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False
    out, probs = torch.ops.bertforge.attention_train(qkv, 2, mask, 0.1, 3)
    dqkv = torch.ops.bertforge.attention_train_backward(torch.randn(2, 5, 32), qkv, probs, 2, 0.1, 3)
    assert torch.all(out[1] == 0) and torch.all(dqkv[1] == 0)
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all() and out[0].abs().sum() > 0


@pytest.mark.parametrize(("call", "message"), [
    (lambda ops: ops.attention_train(torch.randn(2, 5, 3 * 24), 2, None, 0.0, 0), "multiple of 16"),
    (lambda ops: ops.attention_train(torch.randn(2, 5, 96).double(), 2, None, 0.0, 0), "fp32"),
    (lambda ops: ops.attention_train(torch.randn(2, 5, 96), 2, None, 1.0, 0), r"\[0, 1\)"),
    (lambda ops: ops.attention_train(torch.randn(2, 5, 96), 2, torch.ones(2, 4, dtype=torch.bool), 0.0, 0),
     r"mask must be \(B, T\)"),
    (lambda ops: ops.attention_train_backward(torch.randn(2, 5, 32), torch.randn(2, 5, 96), torch.randn(2, 2, 5, 5),
                                              2, 0.0, 0), "attention_train's"),
    (lambda ops: ops.attention_train_backward(torch.randn(2, 5, 48), torch.randn(2, 5, 96), torch.randn(2, 2, 5, 16),
                                              2, 0.0, 0), r"\(B, T, H\)")])
def test_the_ops_refuse_inputs_they_do_not_handle(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(torch.ops.bertforge)


def test_one_and_two_threads_give_the_same_bits():
    """A task is a sequence, whose result depends on nothing else: the same bits on any number of threads."""
    torch.manual_seed(0)
    qkv, grad, mask = torch.randn(5, 19, 3 * 64), torch.randn(5, 19, 64), padded(5, 19)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, probs = torch.ops.bertforge.attention_train(qkv, 2, mask, 0.2, 99)
            results.append((out, probs, torch.ops.bertforge.attention_train_backward(grad, qkv, probs, 2, 0.2, 99)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_dropout_draws_one_key_as_the_unfused_path_does(monkeypatch):
    """The kernels' forward draws its key from torch's generator once, as `bertforge.dropout` does: after it the
    generator is where the unfused path leaves it."""
    module, x = attention_module(2, 16, 0.1), torch.randn(2, 7, 32, requires_grad=True)
    torch.manual_seed(5)
    module(x, None)
    after_kernels = draw_key()
    torch.manual_seed(5)
    monkeypatch.setattr(TrainingAttention, "enabled", False)
    module(x, None)
    assert draw_key() == after_kernels


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_a_packed_batch_gives_the_padded_batchs_results_to_the_bit(p):
    """The real tokens alone, sequence after sequence (offsets), against the right-padded batch: the same outputs and
    gradients at the real tokens, bit for bit (the padded keys add exact zeros; dropout indexes the padded batch's
    probabilities either way), including a sequence of one token and one of none."""
    torch.manual_seed(3)
    T, heads, D = 21, 3, 32
    mask = right_padded([21, 5, 17, 1, 0], T)
    qkv, grad = torch.randn(5, T, 3 * heads * D), torch.randn(5, T, heads * D) * mask[..., None]
    out, probs = torch.ops.bertforge.attention_train(qkv, heads, mask, p, 77)
    dqkv = torch.ops.bertforge.attention_train_backward(grad, qkv, probs, heads, p, 77)
    offsets = torch.tensor([0, 21, 26, 43, 44, 44])
    packed_out, packed_probs = torch.ops.bertforge.attention_train(qkv[mask], heads, None, p, 77, offsets, T)
    packed_dqkv = torch.ops.bertforge.attention_train_backward(grad[mask], qkv[mask], packed_probs, heads, p, 77,
                                                               offsets, T)
    assert torch.equal(packed_out, out[mask]) and torch.equal(packed_dqkv, dqkv[mask])
    # spare rows after the sequences' (the products' rows rounded up): never read, zeros out and back
    spare = torch.full((3, 3 * heads * D), float("nan"))
    spare_out, spare_probs = torch.ops.bertforge.attention_train(torch.cat([qkv[mask], spare]), heads, None, p, 77,
                                                                 offsets, T)
    spare_dqkv = torch.ops.bertforge.attention_train_backward(
        torch.cat([grad[mask], spare[:, :heads * D]]), torch.cat([qkv[mask], spare]), spare_probs, heads, p, 77,
        offsets, T)
    assert torch.equal(spare_out[:44], out[mask]) and torch.equal(spare_dqkv[:44], dqkv[mask])
    assert torch.all(spare_out[44:] == 0) and torch.all(spare_dqkv[44:] == 0)


@pytest.mark.parametrize(("offsets", "message"), [
    ([1, 3, 6], "0 .. rows"), ([0, 3, 7], "0 .. rows"), ([0, 4, 3, 6], "rise by at most length"),
    ([0, 5, 6], "rise by at most length")])
def test_packed_calls_refuse_offsets_that_do_not_fit(offsets, message):
    """Offsets must run from 0 to at most the rows given, rising by at most `length` (here 4) a sequence."""
    with pytest.raises(RuntimeError, match=message):
        torch.ops.bertforge.attention_train(torch.randn(6, 96), 2, None, 0.0, 0, torch.tensor(offsets), 4)


def test_a_packed_call_takes_no_mask():
    with pytest.raises(RuntimeError, match="no mask"):
        torch.ops.bertforge.attention_train(torch.randn(6, 96), 2, torch.ones(2, 3, dtype=torch.bool), 0.0, 0,
                                            torch.tensor([0, 3, 6]), 3)


def classifier(hidden_dropout: float, layers: int = 3) -> BertForSequenceClassification:
    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=128, num_labels=3, hidden_dropout_prob=hidden_dropout,
                        attention_probs_dropout_prob=0.1)
    return BertForSequenceClassification(config).train()


def packed_calls(monkeypatch) -> list[int]:
    calls, pack = [], TrainingPacking.pack
    monkeypatch.setattr(TrainingPacking, "pack", lambda self, x: calls.append(self.tokens) or pack(self, x))
    return calls


def test_a_classifier_trains_the_same_on_its_real_tokens_alone(monkeypatch):
    """A padded batch through a classifier (which reads [CLS] only), with its layers but the last on the real tokens
    alone and without: the same logits and gradients up to fp32 rounding, attention's dropout included."""
    torch.manual_seed(0)
    model, ids = classifier(hidden_dropout=0.0), torch.randint(5, 100, (4, 13))
    mask, labels = right_padded([13, 7, 11, 2], 13).long(), torch.tensor([0, 1, 2, 1])
    calls, results = packed_calls(monkeypatch), []
    for packs in (True, False):
        monkeypatch.setattr(TrainingPacking, "enabled", packs)
        model.zero_grad()
        torch.manual_seed(5)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append([out.logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert calls == [33]  # packed once: 33 real tokens of 52
    for packed, padded in zip(*results, strict=True):
        assert torch.allclose(packed, padded, rtol=1e-5, atol=1e-6 * padded.abs().max().item())


@pytest.mark.parametrize("model_class", [BertForSequenceClassification, BertForTokenClassification])
def test_rows_rounded_up_for_onednn_train_as_the_exact_rows(monkeypatch, model_class):
    """Where the products build a kernel for each shape, the packed rows are rounded up (33 real tokens -> 40 rows):
    the spare rows change no logit or gradient beyond fp32 rounding, and without rounding there are none."""
    from bertforge import training_attention
    torch.manual_seed(0)
    model = model_class(classifier(hidden_dropout=0.1).config).train()
    ids, mask = torch.randint(5, 100, (4, 13)), right_padded([13, 7, 11, 2], 13)
    labels = torch.tensor([0, 1, 2, 1]) if model_class is BertForSequenceClassification else \
        torch.randint(0, 3, (4, 13)).masked_fill(~mask, -100)
    rows, pack, results = [], TrainingPacking.pack, []
    monkeypatch.setattr(TrainingPacking, "pack", lambda self, x: rows.append(len(self.index)) or pack(self, x))
    for rounded in (True, False):
        monkeypatch.setattr(training_attention, "builds_per_shape", lambda device, r=rounded: r)
        model.zero_grad()
        torch.manual_seed(5)
        out = model(input_ids=ids, attention_mask=mask.long(), labels=labels)
        out.loss.backward()
        results.append([out.logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert rows == [40, 33]
    for a, b in zip(*results, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def test_a_tagger_trains_the_same_on_its_real_tokens_alone(monkeypatch):
    """A tagger's labels ignore the padding, so every layer may run on the real tokens alone, one layer too: the same
    logits at the real tokens, the same loss and gradients up to fp32 rounding as the padded batch's."""
    torch.manual_seed(0)
    config = classifier(0.0, layers=1).config.replace(attention_probs_dropout_prob=0.0)
    model, ids = BertForTokenClassification(config).train(), torch.randint(5, 100, (3, 11))
    mask = right_padded([11, 6, 3], 11)
    labels = torch.randint(0, 3, (3, 11)).masked_fill(~mask, -100)
    calls, results = packed_calls(monkeypatch), []
    for packs in (True, False):
        monkeypatch.setattr(TrainingPacking, "enabled", packs)
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask.long(), labels=labels)
        out.loss.backward()
        results.append([out.logits.detach()[mask], out.loss.detach()] + [p.grad.clone() for p in model.parameters()])
    assert calls == [20]
    for packed, padded in zip(*results, strict=True):
        assert torch.allclose(packed, padded, rtol=1e-5, atol=1e-6 * padded.abs().max().item())


def test_models_pack_only_where_it_applies(monkeypatch):
    """Packing takes a training batch with padding through a model whose head reads some positions (with more than
    one layer) or no padded one (a tagger), attention on the kernels, in fp32 or under bf16 autocast; not without
    padding, in evaluation, under fp16 autocast, for a head that reads padded positions (question answering's
    spans), a one-layer classifier, without the kernels, or with `enabled` off."""
    calls = packed_calls(monkeypatch)
    ids, padded, full = torch.randint(5, 100, (2, 9)), right_padded([9, 4], 9).long(), torch.ones(2, 9).long()
    model, config = classifier(hidden_dropout=0.1), classifier(0.1).config
    model(input_ids=ids, attention_mask=padded)
    BertForTokenClassification(config).train()(input_ids=ids, attention_mask=padded)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=padded)
    assert len(calls) == 3
    model(input_ids=ids, attention_mask=full)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=padded)
    with torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=ids, attention_mask=padded)
    model.eval()(input_ids=ids, attention_mask=padded)
    classifier(hidden_dropout=0.1, layers=1)(input_ids=ids, attention_mask=padded)
    BertForQuestionAnswering(config).train()(input_ids=ids, attention_mask=padded)
    with monkeypatch.context() as patched:  # without the kernels (none built, or BERTFORGE_KERNELS=0)
        patched.setattr(kernels, "available", lambda: False)
        classifier(hidden_dropout=0.1)(input_ids=ids, attention_mask=padded)
    monkeypatch.setattr(TrainingPacking, "enabled", False)
    classifier(hidden_dropout=0.1)(input_ids=ids, attention_mask=padded)
    assert len(calls) == 3


def test_under_bf16_autocast_a_classifier_trains_as_close_to_fp32_as_on_the_unfused_path(monkeypatch):
    """A padded batch under bf16 autocast, on the kernels (packed) and on the unfused path: the kernels compute in fp32
    and round once, so their logits and gradients are as near fp32 training's as the unfused path's, or nearer."""
    torch.manual_seed(0)
    model, ids = classifier(hidden_dropout=0.0), torch.randint(5, 100, (4, 13))
    mask, labels = right_padded([13, 7, 11, 2], 13).long(), torch.tensor([0, 1, 2, 1])
    calls, results = packed_calls(monkeypatch), []
    for kernels_on, bf16 in ((True, False), (True, True), (False, True)):
        monkeypatch.setattr(TrainingAttention, "enabled", kernels_on)
        model.zero_grad()
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append([out.logits.detach().double()] + [p.grad.double() for p in model.parameters()
                                                          if p.grad is not None])
    assert calls == [33, 33]  # fp32 and bf16 on the kernels pack; the unfused path does not
    for exact, ours, unfused in zip(*results, strict=True):
        error = float((ours - exact).norm() / exact.norm())
        assert error < 0.05 and error <= 1.25 * float((unfused - exact).norm() / exact.norm()) + 1e-3
