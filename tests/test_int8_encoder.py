"""An int8 encoder a sequence at a time (the kernels' int8_encoder, `FusedEncoder.by_sequence`): the same results as
its layers operator by operator on the VNNI kernels, bit for bit, and chosen only where it pays. Where the VNNI
kernels do not run, test_kernels.py checks that the operator says so and that encoders keep their operators."""

from __future__ import annotations

import pytest
import torch
from infer_support import padded_batch

import bertforge.cpu
import bertforge.infer.fused
import bertforge.infer.transforms
from bertforge import BertConfig
from bertforge.infer import FusedEncoder, quantize_int8
from bertforge.models import BertForSequenceClassification

pytestmark = pytest.mark.skipif(not bertforge.infer.transforms.vnni_products(),
                                reason="the VNNI kernels run on AVX-512 CPUs with avx512_vnni, where the kernels load "
                                       "(the operator's refusal elsewhere: test_kernels.py)")


def _flags(monkeypatch, amx: bool) -> None:
    """This CPU's flags with or without AMX, for the Int8Linears made from now on."""
    flags = bertforge.cpu.cpu_flags() - {"amx_int8", "amx_bf16", "amx_tile"}
    monkeypatch.setattr(bertforge.cpu, "cpu_flags", lambda: flags | ({"amx_int8"} if amx else set()))


def classifier(hidden: int = 64, heads: int = 2, **overrides) -> BertForSequenceClassification:
    torch.manual_seed(0)
    overrides.setdefault("max_position_embeddings", 80)
    config = BertConfig(vocab_size=200, hidden_size=hidden, num_hidden_layers=3, num_attention_heads=heads,
                        intermediate_size=2 * hidden + 8, num_labels=3, **overrides)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():  # LayerNorms and biases away from their initial 1 and 0, as a trained model's are
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("pre_ln", [False, True])
def test_a_sequence_at_a_time_gives_the_operators_results_bit_for_bit(monkeypatch, pre_ln):
    """Post-LN and pre-LN, every position (the encoder's output, padding included) and [CLS] alone (the classifier's
    last layer), an intermediate size not a multiple of 16, one thread or two: the same bits as the same int8 layers
    run operator by operator on the VNNI kernels (each row quantized by its own range, the same int32 sums). On a CPU
    with AMX a sequence's products run on its tiles (where K is a multiple of 64: here all but the feed-forward's
    second), so this checks them against the VNNI kernels."""
    assert not torch.ops.bertforge.amx_tiles() or "amx_int8" in bertforge.cpu.cpu_flags()
    _flags(monkeypatch, amx=False)
    model = quantize_int8(classifier(pre_layer_norm=pre_ln))
    encoder = model.bert.encoder
    assert isinstance(encoder, FusedEncoder) and encoder.sequence_weights is not None
    ids, mask = padded_batch()
    threads = torch.get_num_threads()
    with torch.no_grad():
        got = []
        for n in (1, threads):
            torch.set_num_threads(n)
            got.append((model(ids, attention_mask=mask).logits, model.bert(ids, attention_mask=mask).sequence_output))
        torch.set_num_threads(threads)
        weights, encoder.sequence_weights = encoder.sequence_weights, None  # operator by operator
        expected = model(ids, attention_mask=mask).logits, model.bert(ids, attention_mask=mask).sequence_output
        encoder.sequence_weights = weights
    for run in got:
        for a, b in zip(run, expected, strict=True):
            assert torch.equal(a, b)
    assert expected[1].shape == (6, 23, 64)


def test_which_encoders_run_a_sequence_at_a_time(monkeypatch):
    """Every encoder whose products run on the VNNI kernels, with AMX or without, up to `SEQUENCE_MAX_HIDDEN` wide
    (wider layers' weights would be read from memory again for every sequence); none where the products run on
    oneDNN."""
    most = bertforge.infer.transforms.SEQUENCE_MAX_HIDDEN
    monkeypatch.setattr(bertforge.infer.transforms, "SEQUENCE_MAX_HIDDEN", 128)  # the test's models stay small
    for amx in (False, True):
        _flags(monkeypatch, amx=amx)
        assert quantize_int8(classifier(hidden=128)).bert.encoder.sequence_weights is not None
        assert quantize_int8(classifier(hidden=160)).bert.encoder.sequence_weights is None
    with bertforge.infer.transforms.on_onednn():
        assert quantize_int8(classifier()).bert.encoder.sequence_weights is None
    assert most >= 384  # MiniLM-L6's width


def test_fewer_sequences_than_threads_share_their_work_out_with_the_same_bits(monkeypatch):
    """Fewer sequences than threads (a text served alone) run one after another, each one's products by panels and
    its attention by groups of heads over the threads, where its widest product makes two chunks: the same bits as
    one thread running each sequence, post-LN and pre-LN, every position and [CLS] alone, a mask with a gap; a model
    too small to share stays on one thread. Not on AMX tiles (each thread's own state)."""
    _flags(monkeypatch, amx=False)
    shares = torch.ops.bertforge.int8_encoder_shares
    tiles = torch.ops.bertforge.amx_tiles()
    threads = torch.get_num_threads()
    try:
        for pre_ln in (False, True):
            model = quantize_int8(classifier(hidden=256, heads=4, max_position_embeddings=160, pre_layer_norm=pre_ln))
            ids, mask = padded_batch(T=100, B=3)
            holed = mask.clone()
            holed[:, 1] = 0
            got = {}
            for n in (1, 2, 4):
                torch.set_num_threads(n)
                assert shares(1, 100, 256, 520) == (n > 1 and not tiles)
                assert shares(3, 100, 256, 520) == (n > 3 and not tiles)
                with torch.no_grad():
                    got[n] = [model(ids[:1], attention_mask=mask[:1]).logits, model(ids, attention_mask=holed).logits,
                              model.bert(ids[:1], attention_mask=mask[:1]).sequence_output]
            for n in (2, 4):
                for a, b in zip(got[n], got[1], strict=True):
                    assert torch.equal(a, b), (pre_ln, n)
        torch.set_num_threads(4)
        assert not shares(1, 27, 128, 264)  # BERT-tiny's snippet: each product one chunk, nothing to share
    finally:
        torch.set_num_threads(threads)


def test_which_batches_run_a_sequence_at_a_time(monkeypatch):
    """Without AMX tiles every batch up to the encoder's longest runs on the operator (fewer sequences than threads
    shared out over them). On tiles a batch with fewer sequences than threads longer than `AMX_SHORT_T` would leave
    threads idle, so it runs operator by operator (whose products share the rows out); a short one, or one sequence a
    thread, runs a sequence at a time."""
    _flags(monkeypatch, amx=False)
    model = quantize_int8(classifier(max_position_embeddings=160))
    calls = []
    fused_layer = bertforge.infer.fused._fused_layer
    monkeypatch.setattr(bertforge.infer.fused, "_fused_layer", lambda *a: calls.append(1) or fused_layer(*a))
    tiles = torch.ops.bertforge.amx_tiles()
    short = model.bert.encoder.sequence_short_t
    assert short == (bertforge.infer.fused.AMX_SHORT_T if tiles else model.bert.encoder.max_positions)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.no_grad():
            for T, B, by_operator in ((129, 1, tiles), (128, 1, False), (129, 2, False), (160, 1, tiles)):
                calls.clear()
                model(*padded_batch(T, B))
                assert bool(calls) == by_operator, (T, B)
    finally:
        torch.set_num_threads(threads)


def test_the_operator_refuses_operands_it_cannot_run():
    """Each malformed operand gets one clear error, never a read past a tensor's end."""
    model = quantize_int8(classifier())
    encoder = model.bert.encoder
    weights, eps = encoder.sequence_weights, encoder.sequence_eps
    x = torch.randn(2, 5, 64)
    run = torch.ops.bertforge.int8_encoder
    with pytest.raises(RuntimeError, match="20 tensors a layer"):
        run(x, None, None, weights[:-1], 2, eps, False)
    with pytest.raises(RuntimeError, match="20 tensors a layer"):
        run(x, None, None, weights, 2, eps, True)  # pre-LN needs the final LayerNorm too
    with pytest.raises(RuntimeError, match="vnni_pack's panels"):
        run(x, None, None, [weights[4], *weights[1:]], 2, eps, False)  # the attention output's panels as qkv's
    with pytest.raises(RuntimeError, match="heads x a multiple of 16"):
        run(x, None, None, weights, 3, eps, False)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        run(x.double(), None, None, weights, 2, eps, False)
    with pytest.raises(RuntimeError, match="mask must be"):
        run(x, torch.ones(2, 4, dtype=torch.bool), None, weights, 2, eps, False)
    with pytest.raises(RuntimeError, match="positions must lie"):
        run(x, None, torch.tensor([[0], [5]]), weights, 2, eps, False)
    with pytest.raises(RuntimeError, match="P at most T"):
        run(x, None, torch.zeros(2, 6, dtype=torch.long), weights, 2, eps, False)
    assert run(x, None, torch.tensor([[0], [4]]), weights, 2, eps, False).shape == (2, 1, 64)
    assert run(x[:, :0], None, None, weights, 2, eps, False).shape == (2, 0, 64)  # no rows: nothing to divide up
    assert run(x[:1, :0], None, None, weights, 2, eps, False).shape == (1, 0, 64)
