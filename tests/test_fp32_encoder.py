"""An fp32 encoder a sequence at a time (the kernels' f32_encoder, `FusedEncoder.by_sequence_fp32`): the same bits as
its layers run operator by operator on the kernels' fp32 products, the model's outputs to fp32 rounding, and chosen
for every batch of narrow encoders, a lone text of wider ones (on an AVX-512 CPU, tests/test_kernels.py's child
process runs this file on the AVX2 build too)."""

from __future__ import annotations

import copy

import pytest
import torch
from infer_support import at_threads, padded_batch

from bertforge import BertConfig
from bertforge.infer import EngineOptions, FusedEncoder, packed_linear, transforms
from bertforge.models import BertForSequenceClassification

needs_kernels = pytest.mark.usefixtures("int8_kernels")
pytestmark = pytest.mark.skipif(not transforms._has_onednn_ops(),
                                reason="fp32 products are packed (and encoders fused) only where torch has oneDNN's "
                                       "operators")


def classifier(hidden: int = 64, heads: int = 2, intermediate: int = 144, **overrides):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=200, hidden_size=hidden, num_hidden_layers=3, num_attention_heads=heads,
                        intermediate_size=intermediate, num_labels=3, max_position_embeddings=128, **overrides)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():  # LayerNorms and biases away from their initial 1 and 0, as a trained model's are
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def fast(model: BertForSequenceClassification) -> BertForSequenceClassification:
    return transforms.prepare(copy.deepcopy(model), EngineOptions(), torch.device("cpu"))


def every_product_on_the_kernel(encoder: FusedEncoder) -> None:
    """The encoder's layers, run operator by operator, take every product to the kernels' fp32 one, as
    f32_encoder does."""
    for layer in encoder.layer:
        for product in (layer.attention.qkv, layer.attention_out, layer.intermediate, layer.output):
            product.panels, product.panel_rows = product.kernel_panels(), 1 << 20


@needs_kernels
@pytest.mark.parametrize("pre_ln", [False, True])
def test_a_sequence_at_a_time_gives_the_operators_bits_and_the_models_outputs(pre_ln):
    """Post-LN and pre-LN: [CLS] alone (the classifier: each sequence's padding left out of its layers), [CLS] where
    a gap in the keys makes every row run, every position, and positions out of order: the same bits as the same
    layers operator by operator on the same products, and the plain model's logits to fp32 rounding."""
    model = classifier(pre_layer_norm=pre_ln)
    prepared = fast(model)
    encoder = prepared.bert.encoder
    assert encoder.sequence_fp32 and encoder.sequence_weights is not None
    ids, mask = padded_batch()
    holed = mask.clone()
    holed[:, 1] = 0
    some = torch.tensor([[5, 0, 2, 5]]).expand(ids.shape[0], -1)

    def outputs():
        return (prepared(ids, attention_mask=mask).logits, prepared(ids, attention_mask=holed).logits,
                prepared.bert(ids, attention_mask=mask).sequence_output,
                prepared.bert(ids, attention_mask=mask, positions=some).sequence_output)
    with torch.no_grad():
        got = outputs()
        weights, encoder.sequence_weights = encoder.sequence_weights, None
        every_product_on_the_kernel(encoder)
        expected = outputs()
        plain = model(ids, attention_mask=mask).logits
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[0], plain, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="not f32_pack's panels"):
        torch.ops.bertforge.f32_encoder(torch.zeros(1, 2, 64), None, None, [weights[2], *weights[1:]], 2,
                                        encoder.sequence_eps, pre_ln)
    with pytest.raises(RuntimeError, match="12 tensors a layer"):
        torch.ops.bertforge.f32_encoder(torch.zeros(1, 2, 64), None, None, weights[:-1], 2, encoder.sequence_eps,
                                        pre_ln)


@needs_kernels
def test_a_lone_sequence_shares_its_work_out_with_the_same_bits():
    """A batch of fewer sequences than threads shares each one's products (by panels) and attention (by heads) out
    over them: the same bits at two and four threads as at one, [CLS] alone and every position."""
    model = fast(classifier(hidden=128, heads=2, intermediate=512))
    assert model.bert.encoder.sequence_fp32
    ids = torch.randint(5, 200, (1, 100), generator=torch.Generator().manual_seed(2))
    got = at_threads((1, 2, 4), lambda: (model(ids).logits, model.bert(ids).sequence_output))
    for n in (2, 4):
        for a, b in zip(got[n], got[1], strict=True):
            assert torch.equal(a, b), n


@needs_kernels
def test_narrow_encoders_run_every_batch_a_sequence_at_a_time_wider_ones_a_lone_text():
    """Up to FP32_SEQUENCE_MAX_HIDDEN wide every batch; wider, only batches of fewer sequences than threads of at most
    PANEL_MAX_ROWS tokens (a text served alone), with the bits of the same layers operator by operator; every
    product's outputs a multiple of 16 (the kernel's panels), and not while fp32 products are held on oneDNN
    (`on_onednn`, a side-by-side run's other side)."""
    widest, rows = transforms.FP32_SEQUENCE_MAX_HIDDEN, packed_linear.PANEL_MAX_ROWS
    narrow = fast(classifier(hidden=widest, heads=4, intermediate=4 * widest)).bert.encoder
    wide_model = fast(classifier(hidden=widest + 64, heads=4, intermediate=4 * widest))
    wide = wide_model.bert.encoder
    assert isinstance(wide, FusedEncoder) and narrow.sequence_fp32 and wide.sequence_fp32
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert all(narrow._by_sequence(n, t) for n in (1, 2, 64) for t in (1, rows, rows + 1, 128))
        assert wide._by_sequence(1, 1) and wide._by_sequence(1, rows)
        assert not any(wide._by_sequence(n, t) for n, t in ((1, rows + 1), (2, 5), (64, rows)))
        ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            got = wide_model(ids).logits, wide_model.bert(ids).sequence_output
            wide.sequence_weights = None
            expected = wide_model(ids).logits, wide_model.bert(ids).sequence_output
    finally:
        torch.set_num_threads(before)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert not fast(classifier(intermediate=136)).bert.encoder.sequence_fp32  # 136: not whole panels of 16
    with packed_linear.fp32_on_onednn():
        assert not fast(classifier()).bert.encoder.sequence_fp32
