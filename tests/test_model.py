"""Parity with the reference implementation (transformers), offline, on tiny random models."""

import pytest
import torch
from hf_reference import our_config, padded_pair_batch, tiny_hf_config, transformers

from bertforge import (
    BertConfig,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)
from bertforge.model_files import load_state

ATOL = 1e-5


def paired(hf_cls, our_cls, seed=0, **config):
    torch.manual_seed(seed)
    hc = tiny_hf_config(**config)
    hf = hf_cls(hc).eval()
    ours = our_cls(our_config(hc)).eval()
    load_state(ours, hf.state_dict(), verbose=False)
    return hf, ours, hc


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def test_base_model_sequence_and_pooled_outputs():
    hf, ours, hc = paired(transformers.BertModel, BertModel)
    ids, types, mask = padded_pair_batch(hc.vocab_size)
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    out = ours(ids, types, mask)
    real = mask.bool()
    close(out.sequence_output[real], ref.last_hidden_state[real])
    close(out.pooled_output, ref.pooler_output)


def test_defaults_for_missing_segments_and_mask():
    hf, ours, hc = paired(transformers.BertModel, BertModel)
    ids, _, _ = padded_pair_batch(hc.vocab_size)
    close(ours(ids).sequence_output, hf(input_ids=ids).last_hidden_state)


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_pretraining_outputs_and_losses(act):
    hf, ours, hc = paired(transformers.BertForPreTraining, BertForPreTraining, hidden_act=act)
    ids, types, mask = padded_pair_batch(hc.vocab_size, B=4)
    labels = torch.full_like(ids, -100)
    labels[:, 1:4] = ids[:, 1:4]
    labels[2, 7] = 11
    nsp = torch.tensor([0, 1, 1, 0])
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels, next_sentence_label=nsp)
    out = ours(ids, types, mask, mlm_labels=labels, nsp_labels=nsp)
    selected = labels != -100
    assert out.mlm_logits.shape == (int(selected.sum()), hc.vocab_size)
    close(out.mlm_logits, ref.prediction_logits[selected])
    close(out.nsp_logits, ref.seq_relationship_logits)
    close(out.loss, ref.loss)
    # Without labels: logits for every position.
    dense = ours(ids, types, mask)
    assert dense.loss is None
    close(dense.mlm_logits[mask.bool()], ref.prediction_logits[mask.bool()])


def test_sparse_mlm_loss_equals_dense_loss():
    torch.manual_seed(1)
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=97, max_position_embeddings=64)).eval()
    ids, types, mask = padded_pair_batch(97, B=5, T=20, seed=3)
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, torch.full_like(ids, -100))
    labels[~mask.bool()] = -100
    out = model(ids, types, mask, mlm_labels=labels)
    dense_logits = model(ids, types, mask).mlm_logits
    dense_loss = torch.nn.functional.cross_entropy(dense_logits.view(-1, 97), labels.view(-1), ignore_index=-100)
    close(out.mlm_loss, dense_loss, atol=1e-6)
    assert out.loss == out.mlm_loss  # no NSP labels: the loss is the MLM loss alone


def test_mlm_positions_lists_cls_then_the_labelled_positions():
    from bertforge.models import mlm_positions

    labels = torch.tensor([[-100, 5, -100, 7], [-100, -100, -100, -100], [-100, -100, 9, -100]])
    positions, picked = mlm_positions(labels)
    assert positions.tolist() == [[0, 1, 3], [0, 0, 0], [0, 2, 0]]
    assert picked.tolist() == [[-100, 5, 7], [-100, -100, -100], [-100, 9, -100]]


def test_pretraining_gradients_match_reference():
    torch.manual_seed(0)
    hc = tiny_hf_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = transformers.BertForPreTraining(hc).train()
    ours = BertForPreTraining(our_config(hc)).train()
    load_state(ours, hf.state_dict(), verbose=False)
    ids, types, mask = padded_pair_batch(hc.vocab_size, B=4)
    labels = torch.full_like(ids, -100)
    labels[:, 2:6] = ids[:, 2:6]
    nsp = torch.tensor([0, 1, 1, 0])
    hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels, next_sentence_label=nsp).loss.backward()
    ours(ids, types, mask, mlm_labels=labels, nsp_labels=nsp).loss.backward()
    from bertforge.model_files import from_hf_state_dict

    ref_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters() if p.grad is not None},
                                   with_bert_prefix=True)
    checked = 0
    for name, p in ours.named_parameters():
        ref = ref_grads[name]
        scale = ref.abs().max().clamp_min(1e-8)
        assert (p.grad - ref).abs().max() / scale < 1e-4, name
        checked += 1
    assert checked == len(list(ours.parameters()))


def test_masked_lm():
    hf, ours, hc = paired(transformers.BertForMaskedLM, BertForMaskedLM)
    ids, types, mask = padded_pair_batch(hc.vocab_size)
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels)
    out = ours(ids, types, mask, labels=labels)
    close(out.logits, ref.logits[labels != -100])
    close(out.loss, ref.loss)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_sequence_classification_and_regression(num_labels):
    hf, ours, hc = paired(transformers.BertForSequenceClassification, BertForSequenceClassification,
                          num_labels=num_labels)
    ids, types, mask = padded_pair_batch(hc.vocab_size)
    labels = torch.tensor([0.5, -1.0, 2.0]) if num_labels == 1 else torch.tensor([0, 2, 1])
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels)
    out = ours(ids, types, mask, labels=labels)
    close(out.logits, ref.logits)
    close(out.loss, ref.loss)


def test_cls_only_last_layer_gives_the_full_models_cls_state():
    hf, ours, hc = paired(transformers.BertModel, BertModel)
    ids, types, mask = padded_pair_batch(hc.vocab_size)
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    out = ours(ids, types, mask, cls_only=True)
    assert out.sequence_output.shape == (ids.shape[0], 1, hc.hidden_size)
    close(out.sequence_output[:, 0], ref.last_hidden_state[:, 0])
    close(out.pooled_output, ref.pooler_output)


def test_classification_gradients_match_reference():
    # Our classifier computes the last layer at [CLS] only; the reference computes it everywhere.
    torch.manual_seed(0)
    hc = tiny_hf_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    hf = transformers.BertForSequenceClassification(hc).train()
    ours = BertForSequenceClassification(our_config(hc)).train()
    load_state(ours, hf.state_dict(), verbose=False)
    ids, types, mask = padded_pair_batch(hc.vocab_size)
    labels = torch.tensor([0, 2, 1])
    hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels).loss.backward()
    ours(ids, types, mask, labels=labels).loss.backward()
    from bertforge.model_files import from_hf_state_dict

    ref_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, with_bert_prefix=True)
    for name, p in ours.named_parameters():
        ref = ref_grads[name]
        assert ref is not None and p.grad is not None, name
        assert (p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-8) < 1e-4, name


def test_token_classification():
    hf, ours, hc = paired(transformers.BertForTokenClassification, BertForTokenClassification, num_labels=5)
    ids, types, mask = padded_pair_batch(hc.vocab_size)
    labels = torch.randint(0, 5, ids.shape)
    labels[~mask.bool()] = -100
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels)
    out = ours(ids, types, mask, labels=labels)
    close(out.logits[mask.bool()], ref.logits[mask.bool()])
    close(out.loss, ref.loss)


def test_question_answering():
    hf, ours, hc = paired(transformers.BertForQuestionAnswering, BertForQuestionAnswering)
    ids, types, mask = padded_pair_batch(hc.vocab_size)
    start, end = torch.tensor([3, 5, 40]), torch.tensor([4, 9, 41])  # the last lies outside: ignored
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, start_positions=start, end_positions=end)
    out = ours(ids, types, mask, start_positions=start, end_positions=end)
    real = mask.bool()
    close(out.start_logits[real], ref.start_logits[real])
    close(out.end_logits[real], ref.end_logits[real])
    close(out.loss, ref.loss)


def test_multiple_choice():
    hf, ours, hc = paired(transformers.BertForMultipleChoice, BertForMultipleChoice)
    ids, types, mask = padded_pair_batch(hc.vocab_size, B=2, choices=4)
    labels = torch.tensor([3, 1])
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels)
    out = ours(ids, types, mask, labels=labels)
    assert out.logits.shape == (2, 4)
    close(out.logits, ref.logits)
    close(out.loss, ref.loss)


def test_initialisation_follows_bert():
    torch.manual_seed(0)
    config = BertConfig.from_preset("mini", vocab_size=5000, initializer_range=0.02)
    model = BertForPreTraining(config)
    w = model.bert.encoder.layer[0].intermediate.weight
    n = w.numel()
    # The sample std of n normal draws has a standard error of about std / sqrt(2n).
    assert abs(w.std().item() - 0.02) < 6 * 0.02 / (2 * n) ** 0.5
    assert abs(w.mean().item()) < 6 * 0.02 / n ** 0.5
    assert torch.all(model.bert.encoder.layer[0].intermediate.bias == 0)
    assert torch.all(model.bert.embeddings.LayerNorm.weight == 1)
    assert torch.all(model.bert.embeddings.word_embeddings.weight[config.pad_token_id] == 0)
    assert torch.all(model.cls.predictions.bias == 0)


def test_mlm_decoder_is_tied_to_word_embeddings():
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=50))
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight[7].fill_(3.0)
    h = torch.randn(1, 128)
    logits = model.cls.predictions(h, model.bert.embeddings.word_embeddings)
    expected = model.cls.predictions.transform(h) @ model.bert.embeddings.word_embeddings.weight.T
    close(logits, expected)
    names = [n for n, _ in model.named_parameters()]
    assert not any("decoder" in n for n in names)


def test_too_long_input_is_refused():
    model = BertModel(BertConfig.from_preset("tiny", vocab_size=50, max_position_embeddings=8))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_explicit_attention_equals_the_fused_kernel_with_padding_and_query_subsets():
    from bertforge.encoder import _explicit_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(3, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., 4:] = False  # a padded sequence
    for queries in (q, q[:, :, [0, 3, 5]]):  # every position, or a few of them against all keys
        ours = _explicit_attention(queries, k, v, mask, 0.0)
        ref = torch.nn.functional.scaled_dot_product_attention(queries, k, v, attn_mask=mask)
        torch.testing.assert_close(ours, ref)
        grads = torch.autograd.grad(ours.sum(), (q, k, v), retain_graph=True)
        ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b)


def test_bf16_on_a_cpu_takes_the_explicit_attention_for_short_sequences_and_matches_the_fused_one(monkeypatch):
    """`attend`'s choice where training's kernels do not take the attention (without them, or heads they do not
    take): here they are switched off."""
    from bertforge import encoder as model_module
    from bertforge.training_attention import TrainingAttention

    monkeypatch.setattr(TrainingAttention, "enabled", False)
    torch.manual_seed(0)
    config = BertConfig.from_preset("tiny", vocab_size=100, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    attention = model_module.BertSelfAttention(config).train()
    x = torch.randn(2, 16, config.hidden_size)
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    mask[0, ..., 10:] = False
    fused_calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: fused_calls.append(1) or real_sdpa(*a, **kw))
    limit = model_module._EXPLICIT_INFERENCE_MAX_T
    with torch.autocast("cpu", torch.bfloat16):
        explicit = attention(x, mask)
        assert not fused_calls  # short sequence, bf16, training: the explicit kernel
        with torch.no_grad():
            inferred = attention(x, mask)  # bf16 inference up to _EXPLICIT_INFERENCE_MAX_T keys: explicit too
            assert not fused_calls
            monkeypatch.setattr(model_module, "_EXPLICIT_INFERENCE_MAX_T", 0)
            fused = attention(x, mask)
            monkeypatch.setattr(model_module, "_EXPLICIT_INFERENCE_MAX_T", limit)
        assert len(fused_calls) == 1
    torch.testing.assert_close(explicit.float(), fused.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(inferred.float(), fused.float(), atol=2e-2, rtol=2e-2)
    with torch.autocast("cpu", torch.bfloat16):
        attention(torch.randn(1, model_module._EXPLICIT_ATTENTION_MAX_T + 1, config.hidden_size), None)
        assert len(fused_calls) == 2  # long sequences keep the fused kernel in training
        with torch.no_grad():
            attention(torch.randn(1, limit, config.hidden_size), None)
            assert len(fused_calls) == 2
            attention(torch.randn(1, limit + 1, config.hidden_size), None)
            assert len(fused_calls) == 3  # and in inference beyond its own limit
    with torch.no_grad():
        attention(x, mask)  # fp32 inference: the fused kernel
    assert len(fused_calls) == 4


@pytest.mark.parametrize("tied", [True, False])
def test_the_masked_lm_moves_the_input_embeddings_of_absent_words_only_through_a_tied_decoder(tied):
    torch.manual_seed(0)
    config = BertConfig.from_preset("tiny", vocab_size=50, hidden_size=32, num_attention_heads=2,
                                    intermediate_size=64, tie_word_embeddings=tied)
    model = BertForPreTraining(config)
    ids = torch.tensor([[2, 10, 11, 12, 3]])  # words 13..49 are in no input
    labels = torch.full_like(ids, -100)
    labels[0, 2] = 11
    model(ids, mlm_labels=labels).mlm_loss.backward()
    grad = model.bert.embeddings.word_embeddings.weight.grad
    absent = grad[13:].abs().amax(dim=1)
    if tied:  # every word's softmax share pushes its row: the push that collapses rare words together
        assert (absent > 0).all()
    else:
        assert torch.equal(absent, torch.zeros_like(absent))
        assert (model.cls.predictions.decoder.weight.grad[13:].abs().amax(dim=1) > 0).all()
    assert (grad[[10, 11, 12]].abs().amax(dim=1) > 0).all()
