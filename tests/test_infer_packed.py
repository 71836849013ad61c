"""Packed (unpadded) inference (`bertforge.infer.packing`): every head's outputs on a padded batch of random lengths
equal the unpacked model's, post-LN and pre-LN, fp32 and bf16, and the packed path is the one that ran; and which
models `prepare` packs."""

import copy

import pytest
import torch

from bertforge import cpu
from bertforge.infer import EngineOptions
from bertforge.infer.packing import (
    PackedEncoder,
    PackedSelfAttention,
    Packing,
    is_packed,
    pack_sequences,
)
from bertforge.infer.transforms import pack_linears, prepare
from bertforge.linear import packed_rows
from bertforge.models import (
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)

CPU = torch.device("cpu")


def padded_batch(vocab: int, lengths: list[int], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random ids right-padded to the longest of `lengths`, segment B in each row's second half, and the mask."""
    T = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), T), generator=generator)
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()  # (B, T)
    types = (torch.arange(T) >= torch.tensor(lengths)[:, None] // 2).long() * mask
    return {"input_ids": ids * mask, "token_type_ids": types, "attention_mask": mask}


def packed_calls(model: torch.nn.Module) -> list[int]:
    """A list that counts the attention calls made on packed rows."""
    calls: list[int] = []
    for module in model.modules():
        if isinstance(module, PackedSelfAttention):
            module.register_forward_pre_hook(lambda m, args: calls.append(1) if isinstance(args[1], Packing) else None)
    return calls


def both(model: torch.nn.Module, precision: str = "fp32") -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model as it is, in the dtype of `precision`; its copy with packed Linear layers, packed). `prepare` runs
    an fp32 encoder on the kernels where they load (`fused`, tests/test_kernels.py) and a bf16 one's attention
    (test_bf16_attention_runs_on_the_kernels below): here packed as where they do not."""
    model.eval()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    reference = copy.deepcopy(model).to(dtype)
    return reference, pack_sequences(pack_linears(model.to(dtype)))


def real(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The values at real tokens only (the padded path computes padding's too, the packed one zeros)."""
    return out[mask.bool()]


@pytest.mark.parametrize("pre_ln", [False, True])
def test_every_head_on_packed_rows_equals_the_padded_model(tiny_config, pre_ln):
    config = tiny_config.replace(pre_layer_norm=pre_ln, num_labels=3)
    g = torch.Generator().manual_seed(0)
    batch = padded_batch(config.vocab_size, [9, 3, 17, 1, 12, 17, 5], g)
    torch.manual_seed(0)
    with torch.no_grad():
        for cls in (BertForSequenceClassification, BertForTokenClassification, BertForQuestionAnswering):
            reference, packed = both(cls(config))
            calls = packed_calls(packed)
            want, got = reference(**batch), packed(**batch)
            assert len(calls) == config.num_hidden_layers
            if cls is BertForQuestionAnswering:
                for a, b in ((want.start_logits, got.start_logits), (want.end_logits, got.end_logits)):
                    torch.testing.assert_close(real(b, batch["attention_mask"]), real(a, batch["attention_mask"]))
            elif cls is BertForTokenClassification:
                torch.testing.assert_close(real(got.logits, batch["attention_mask"]),
                                           real(want.logits, batch["attention_mask"]))
            else:
                torch.testing.assert_close(got.logits, want.logits)

        reference, packed = both(BertForMultipleChoice(config))
        choices = {k: v[:6].view(2, 3, -1) for k, v in batch.items()}  # (B, C, T)
        torch.testing.assert_close(packed(**choices).logits, reference(**choices).logits)


def test_masked_positions_embeddings_and_an_unpadded_batch(tiny_config):
    g = torch.Generator().manual_seed(1)
    batch = padded_batch(tiny_config.vocab_size, [6, 14, 2, 9], g)
    labels = torch.full_like(batch["input_ids"], -100)
    labels[0, 3], labels[1, 1], labels[1, 13], labels[3, 8] = 7, 8, 9, 10  # masks at real tokens only
    torch.manual_seed(1)
    reference, packed = both(BertForMaskedLM(tiny_config))
    calls = packed_calls(packed)
    with torch.no_grad():
        torch.testing.assert_close(packed(**batch, labels=labels).logits, reference(**batch, labels=labels).logits)
        assert len(calls) == tiny_config.num_hidden_layers
        for kwargs in ({}, {"cls_only": True}):  # every position (mean pooling reads them), and [CLS] alone
            want = reference.bert(**batch, **kwargs).sequence_output
            got = packed.bert(**batch, **kwargs).sequence_output
            if kwargs:
                torch.testing.assert_close(got, want)
            else:
                torch.testing.assert_close(real(got, batch["attention_mask"]), real(want, batch["attention_mask"]))
                assert not got[~batch["attention_mask"].bool()].any()
        full = {k: v[:, :2] for k, v in batch.items()}  # no padding: packed all the same (rows rounded up)
        torch.testing.assert_close(packed.bert(**full).sequence_output, reference.bert(**full).sequence_output)
    assert len(calls) == 4 * tiny_config.num_hidden_layers


def test_training_mode_runs_the_padded_layers(tiny_config):
    torch.manual_seed(2)
    _, packed = both(BertForSequenceClassification(tiny_config))
    encoder = packed.bert.encoder
    assert isinstance(encoder, PackedEncoder)
    calls = packed_calls(packed)
    batch = padded_batch(tiny_config.vocab_size, [4, 8], torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed.train()(**batch)
    assert calls == []


@pytest.mark.skipif(not cpu.has_native_bf16(), reason="this CPU does not multiply bf16 natively")
def test_bf16_packed_equals_bf16_padded(tiny_config):
    batch = padded_batch(tiny_config.vocab_size, [11, 4, 30, 7], torch.Generator().manual_seed(3))
    torch.manual_seed(3)
    reference, packed = both(BertForSequenceClassification(tiny_config), "bf16")
    with torch.no_grad():
        want, got = reference(**batch).logits.float(), packed(**batch).logits.float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16 rounding, products blocked differently


@pytest.mark.skipif(not cpu.has_native_bf16(), reason="this CPU does not multiply bf16 natively")
@pytest.mark.parametrize("pre_ln", [False, True])
def test_bf16_attention_runs_on_the_kernels(tiny_config, pre_ln):
    """`prepare` in bf16 where the kernels load: every layer's attention on the kernels' operator
    (`KernelSelfAttention`, a padded batch, not packed), the feed-forward GELU inside its product; the logits, the
    [CLS] rows and every real position within bf16 rounding of the plain bf16 model's, post-LN and pre-LN; training
    mode runs the attention it wraps."""
    from bertforge import kernels
    from bertforge.infer.fused import KernelSelfAttention

    if not kernels.available():
        pytest.skip("bertforge's kernels do not load here (bf16 runs packed: the test above)")
    tiny_config.pre_layer_norm = pre_ln
    tiny_config.initializer_range = 0.2  # sharper attention than at 0.02, so a key left unmasked would show (seen:
    # 1.7 at most and 0.17 on average against 0.03 and 0.006; logits 1.0 apart against 0.007)
    torch.manual_seed(5)
    model = BertForSequenceClassification(tiny_config).eval()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    fast = prepare(model, EngineOptions(precision="bf16"), CPU)
    assert not is_packed(fast)
    layers = fast.bert.encoder.layer
    assert all(isinstance(layer.attention, KernelSelfAttention) for layer in layers)
    assert all(layer.intermediate.activation == "gelu" for layer in layers)
    calls = []
    for layer in layers:
        layer.attention.inner.register_forward_hook(lambda *a: calls.append(1))
    batch = padded_batch(tiny_config.vocab_size, [11, 4, 30, 7], torch.Generator().manual_seed(5))
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(fast(**batch).logits.float(), reference(**batch).logits.float(), atol=3e-2,
                                   rtol=0)
        for kwargs in ({}, {"cls_only": True}):
            got = fast.bert(**batch, **kwargs).sequence_output.float()
            want = reference.bert(**batch, **kwargs).sequence_output.float()
            if not kwargs:
                got, want = got[real], want[real]
            torch.testing.assert_close(got, want, atol=8e-2, rtol=0)
            assert (got - want).abs().mean() < 0.02
        assert not calls  # the wrapped module's attention did not run
        fast.train()(**batch)
    assert len(calls) == tiny_config.num_hidden_layers


def test_fp32_models_are_fused_or_packed_int8_ones_are_not_packed_and_a_server_cuts_its_groups_in_four(tiny_config):
    from bertforge import kernels
    from bertforge.infer import FusedEncoder
    from bertforge.serve.model import group_batch_size

    torch.manual_seed(4)
    fp32 = prepare(BertForSequenceClassification(tiny_config).eval(), EngineOptions(), CPU)
    assert isinstance(fp32.bert.encoder, FusedEncoder) if kernels.available() else is_packed(fp32)
    assert not is_packed(prepare(BertForSequenceClassification(tiny_config).eval(), EngineOptions(quantize="int8"),
                                 CPU))
    assert not is_packed(BertForSequenceClassification(tiny_config))
    assert [group_batch_size(n) for n in (1, 8, 32, 33, 1000)] == [1, 2, 8, 9, 64]


def test_packed_row_counts_are_few_and_waste_little():
    # every token count of a batch up to 64 texts of 128 tokens runs at one of a few row counts (each a shape the
    # products build and cache once), none more than a thirty-second (or 7 rows) above the real tokens
    counts = {packed_rows(s) for s in range(1, 8193)}
    assert len(counts) <= 200
    for s in range(1, 8193):
        assert s <= packed_rows(s) <= max(s + 7, s * 33 // 32)
    assert packed_rows(16) == 16 and packed_rows(17) == 24 and packed_rows(1000) == 1008


def test_spare_rows_change_no_real_output(tiny_config):
    # 1 + 16 = 17 real tokens run as 24 rows: 7 spare ones, copies of the first, must reach no output
    model = BertForTokenClassification(tiny_config.replace(num_labels=3))
    reference, packed = both(model)
    batch = padded_batch(tiny_config.vocab_size, [1, 16], torch.Generator().manual_seed(4))
    calls = packed_calls(packed)
    with torch.no_grad():
        want, got = reference(**batch).logits, packed(**batch).logits
    assert calls and packed_rows(17) == 24
    torch.testing.assert_close(real(got, batch["attention_mask"]), real(want, batch["attention_mask"]),
                               rtol=1e-4, atol=1e-5)
