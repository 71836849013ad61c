"""The BERT models: the encoder (`encoder.BertModel`) with a head. Pretraining (`BertForPreTraining`: MLM tied to
the word embeddings, NSP; `BertForMaskedLM`) and the task models (sequence and token classification, extractive
QA, multiple choice), each with its head module.

Shapes: B batch, T tokens, H hidden, V vocabulary, C choices, M labelled (masked) positions.
Labels use ignore index -100: positions with -100 contribute nothing to any loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bertforge.config import BertConfig
from bertforge.dropout import Dropout
from bertforge.encoder import CLS_INDEX, BertModel, BertPreTrainedModel, activation
from bertforge.linear import Linear, linear

IGNORE_INDEX = -100


class BertPredictionHeadTransform(nn.Module):
    """dense -> activation -> LayerNorm, applied before the vocabulary projection."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.act = activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """Masked-LM head: transform, then logits = h @ E^T + b with E the (tied) word embedding matrix, or the
    head's own `decoder` matrix where the config unties them (`tie_word_embeddings` False)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                      bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: torch.Tensor, word_embeddings: nn.Embedding) -> torch.Tensor:
        """hidden (..., H) -> logits (..., V). A tied decoder is the model's word embeddings, passed in rather
        than held, so the tied matrix has one owner and appears once in state_dict."""
        if self.decoder is not None:  # a module call, so inference's Linear swaps (packed, int8) apply to it
            return self.decoder(self.transform(hidden)) + self.bias
        return linear(self.transform(hidden), word_embeddings.weight, self.bias)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig, *, nsp: bool = True):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2) if nsp else None


# The masked-LM head's rows (labelled positions) and a sampled softmax's candidate columns, rounded up to these
# multiples, the padding left out of the loss: their counts change every step, and under bf16 autocast on a CPU oneDNN
# builds (and keeps) kernels for every new matrix shape. BERT-tiny's budget-recipe step at batch 16 took 27-28 ms with
# the exact counts, most of the difference in building kernels and faulting in fresh memory for them (1,000-1,500 page
# faults a step; the process grew by ~3.5 MB a step), against 16 ms with these; in fp32 (MKL, no kernel per shape)
# 19-20 ms either way (docs/benchmarks.md, twenty-seventh session).
HEAD_ROWS_MULTIPLE = 32
CANDIDATES_MULTIPLE = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def labelled_rows(sequence_output: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(hidden (M', H), targets (M',), M): the M labelled positions' states in row-major (batch, then position)
    order and their labels, followed by padding rows (the first position's state, label -100) up to M' =
    `HEAD_ROWS_MULTIPLE`'s next multiple."""
    flat = labels.reshape(-1)
    rows = (flat != IGNORE_INDEX).nonzero()[:, 0]
    count = rows.numel()
    rows = torch.cat([rows, rows.new_zeros(_round_up(count, HEAD_ROWS_MULTIPLE) - count)])
    targets = flat[rows]
    targets[count:] = IGNORE_INDEX
    return sequence_output.reshape(-1, sequence_output.shape[-1])[rows], targets, count


def masked_lm(head: BertLMPredictionHead, word_embeddings: nn.Embedding, sequence_output: torch.Tensor,
              labels: torch.Tensor | None):
    """Run the MLM head, on the labelled positions only when labels are given.

    Returns (logits, loss). With labels, logits are (M, V) for the M positions where labels != -100, in
    row-major (batch, then position) order, and loss is their mean cross-entropy: exactly the dense loss,
    at about 15% of the vocabulary projection's cost (the head runs on `labelled_rows`' padded rows). Without labels,
    logits are (B, T, V) and loss None.
    """
    if labels is None:
        return head(sequence_output, word_embeddings), None
    hidden, targets, count = labelled_rows(sequence_output, labels)
    logits = head(hidden, word_embeddings)  # (M', V)
    loss = F.cross_entropy(logits.float(), targets)  # the padding's -100 left out of the mean
    return logits[:count], loss


def sampled_masked_lm(head: BertLMPredictionHead, word_embeddings: nn.Embedding, sequence_output: torch.Tensor,
                      labels: torch.Tensor, candidates: torch.Tensor, log_inclusion: torch.Tensor):
    """The masked-LM loss as a sampled softmax (Jean et al. 2015): each labelled position scores its own word
    against a shared set of sampled words `candidates` (K,) instead of the whole vocabulary, every logit less the
    log of its word's chance to be in the set (`log_inclusion` (V,)), so the expected gradient approaches the full
    softmax's. A candidate equal to the position's word is left out for that position. The decoder's matrix
    product shrinks from V to K columns. Returns (logits (M, 1 + K): the own word first, loss). The rows are
    `labelled_rows`' padded ones and the columns padded to `CANDIDATES_MULTIPLE`'s next multiple with logits of
    -inf, which the softmax gives nothing; both paddings are cut from the logits returned."""
    hidden, targets, count = labelled_rows(sequence_output, labels)
    hidden = head.transform(hidden)  # (M', H)
    words = targets.clamp_min(0)  # the padding rows score word 0, left out of the loss
    k = candidates.numel()
    padding = torch.arange(_round_up(k, CANDIDATES_MULTIPLE), device=candidates.device) >= k  # (K',)
    candidates = torch.cat([candidates, candidates.new_zeros(padding.numel() - k)])
    weight = word_embeddings.weight if head.decoder is None else head.decoder.weight  # (V, H)
    own = (hidden * weight[words]).sum(-1) + head.bias[words] - log_inclusion[words]  # (M',)
    others = linear(hidden, weight[candidates], head.bias[candidates] - log_inclusion[candidates])  # (M', K')
    others = others.masked_fill((candidates[None, :] == words[:, None]) | padding[None, :], float("-inf"))
    logits = torch.cat([own[:, None], others], 1).float()
    goal = torch.where(targets == IGNORE_INDEX, IGNORE_INDEX, 0)  # the own word, column 0; -100 on the padding
    return logits[:count, :k + 1], F.cross_entropy(logits, goal)


def bag_of_words(head: BertLMPredictionHead, word_embeddings: nn.Embedding, cls_output: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor:
    """[CLS] predicts the words of its sequence through the masked-LM head: one softmax per sequence from
    cls_output (B, H), scored on each of the sequence's tokens (labels (B, T): token ids, -100 outside the bag).
    Returns the mean over sequences of the mean cross-entropy over their tokens, which is the cross-entropy
    against the sequence's word distribution (repeated words count as often as they occur)."""
    log_probs = F.log_softmax(head(cls_output, word_embeddings).float(), -1)  # (B, V)
    inside = labels != IGNORE_INDEX
    picked = log_probs.gather(1, labels.clamp_min(0)) * inside  # (B, T)
    per_sequence = picked.sum(1) / inside.sum(1).clamp_min(1)
    return -per_sequence.sum() / inside.any(1).sum().clamp_min(1)


MLM_CLS_COLUMN = 0  # `mlm_positions` puts [CLS] in this column, for the pooler


def mlm_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions the masked-LM and NSP heads read, for `BertModel(positions=...)`: per row, [CLS] (for the
    pooler) in column MLM_CLS_COLUMN, then the labelled positions in order, padded with [CLS] to the longest
    row; and the labels at those positions (-100 at [CLS] and the padding). (B, 1 + P) each."""
    chosen = labels != IGNORE_INDEX
    counts = chosen.sum(1, keepdim=True)  # (B, 1)
    width = int(counts.max()) if labels.numel() else 0
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)[:, :width]  # labelled first, in order
    valid = torch.arange(width, device=labels.device) < counts
    positions = torch.where(valid, order, CLS_INDEX)
    picked = torch.where(valid, labels.gather(1, order), IGNORE_INDEX)
    first = torch.full_like(labels[:, :1], CLS_INDEX)
    return torch.cat([first, positions], 1), torch.cat([torch.full_like(first, IGNORE_INDEX), picked], 1)


@dataclass
class PreTrainingOutput:
    loss: torch.Tensor | None  # mean MLM + mean NSP + bag of words (whichever labels were given)
    mlm_logits: torch.Tensor  # (M, V) labelled positions only when mlm_labels given, else (B, T, V)
    nsp_logits: torch.Tensor  # (B, 2): index 0 IsNext, 1 NotNext
    mlm_loss: torch.Tensor | None = None
    nsp_loss: torch.Tensor | None = None
    bow_loss: torch.Tensor | None = None


@dataclass
class MaskedLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor  # (M, V) with labels, (B, T, V) without


@dataclass
class TaskOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor  # (B, num_labels), (B, T, num_labels) for tagging, (B, C) for multiple choice


@dataclass
class QuestionAnsweringOutput:
    loss: torch.Tensor | None
    start_logits: torch.Tensor  # (B, T)
    end_logits: torch.Tensor  # (B, T)


class BertForPreTraining(BertPreTrainedModel):
    """BERT with the masked-LM and next-sentence-prediction heads."""

    hf_architecture = "BertForPreTraining"

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.init_weights()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, mlm_labels=None,
                nsp_labels=None, bow_labels=None, mlm_candidates=None) -> PreTrainingOutput:
        """mlm_labels (B, T): original token ids at predicted positions, -100 elsewhere.
        nsp_labels (B,): 0 if B follows A in the corpus (IsNext), 1 if B is random (NotNext).
        bow_labels (B, T): the sequence's original token ids, -100 at special tokens and padding, for the
        bag-of-words loss on [CLS] (`bag_of_words`); it adds no weights, the masked-LM head scores it.
        mlm_candidates: (candidates (K,), log_inclusion (V,)) scores the masked-LM as a sampled softmax
        (`sampled_masked_lm`; its logits are then (M, 1 + K)).
        With mlm_labels, the last layer runs only where the heads read (`mlm_positions`)."""
        positions = None
        if mlm_labels is not None:
            positions, mlm_labels = mlm_positions(mlm_labels)
        out = self.bert(input_ids, token_type_ids, attention_mask, positions=positions, cls_column=MLM_CLS_COLUMN)
        if mlm_candidates is not None and mlm_labels is not None:
            mlm_logits, mlm_loss = sampled_masked_lm(self.cls.predictions, self.bert.embeddings.word_embeddings,
                                                     out.sequence_output, mlm_labels, *mlm_candidates)
        else:
            mlm_logits, mlm_loss = masked_lm(self.cls.predictions, self.bert.embeddings.word_embeddings,
                                             out.sequence_output, mlm_labels)
        nsp_logits = self.cls.seq_relationship(out.pooled_output)
        nsp_loss = F.cross_entropy(nsp_logits.float(), nsp_labels) if nsp_labels is not None else None
        bow_loss = None
        if bow_labels is not None:
            cls_output = out.sequence_output[:, CLS_INDEX if positions is None else MLM_CLS_COLUMN]
            bow_loss = bag_of_words(self.cls.predictions, self.bert.embeddings.word_embeddings, cls_output,
                                    bow_labels)
        losses = [x for x in (mlm_loss, nsp_loss, bow_loss) if x is not None]
        loss = sum(losses[1:], losses[0]) if losses else None
        return PreTrainingOutput(loss, mlm_logits, nsp_logits, mlm_loss, nsp_loss, bow_loss)


class BertForMaskedLM(BertPreTrainedModel):
    """BERT with the masked-LM head only (no pooler, no NSP)."""

    hf_architecture = "BertForMaskedLM"

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertPreTrainingHeads(config, nsp=False)
        self.init_weights()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None) -> MaskedLMOutput:
        positions = None
        if labels is not None:
            positions, labels = mlm_positions(labels)
        out = self.bert(input_ids, token_type_ids, attention_mask, positions=positions)  # no pooler
        # the decoder is tied: it is the word embedding matrix
        logits, loss = masked_lm(self.cls.predictions, self.bert.embeddings.word_embeddings, out.sequence_output,
                                 labels)
        return MaskedLMOutput(loss, logits)


def _classifier_dropout(config: BertConfig) -> Dropout:
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return Dropout(p)


class BertForSequenceClassification(BertPreTrainedModel):
    """Pooled [CLS] -> dropout -> linear. num_labels == 1 makes it a regression (mean squared error)."""

    hf_architecture = "BertForSequenceClassification"
    looks_up_words = True

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None) -> TaskOutput:
        """labels (B,): class ids, or float targets when num_labels == 1."""
        pooled = self.bert(input_ids, token_type_ids, attention_mask, cls_only=True).pooled_output
        logits = self.classifier(self.dropout(pooled))  # (B, num_labels)
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels)
        return TaskOutput(loss, logits)


class BertForTokenClassification(BertPreTrainedModel):
    """Every token's final state -> dropout -> linear: one label per token (NER tagging)."""

    hf_architecture = "BertForTokenClassification"
    looks_up_words = True

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=False)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None) -> TaskOutput:
        """labels (B, T): label ids, -100 on specials, padding and non-first sub-tokens."""
        x = self.bert(input_ids, token_type_ids, attention_mask, reads_padding=False).sequence_output
        logits = self.classifier(self.dropout(x))  # (B, T, num_labels)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return TaskOutput(loss, logits)


class BertForQuestionAnswering(BertPreTrainedModel):
    """Extractive QA: a start and an end logit for every token."""

    hf_architecture = "BertForQuestionAnswering"
    looks_up_words = True

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config.replace(num_labels=2, id2label=None)
        self.bert = BertModel(self.config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, start_positions=None,
                end_positions=None) -> QuestionAnsweringOutput:
        """start_positions, end_positions (B,): token indices of the answer span; positions outside the
        sequence are ignored (the convention of the reference implementation)."""
        x = self.bert(input_ids, token_type_ids, attention_mask).sequence_output
        start_logits, end_logits = self.qa_outputs(x).unbind(-1)  # each (B, T)
        loss = None
        if start_positions is not None and end_positions is not None:
            T = start_logits.shape[1]
            start = start_positions.clamp(0, T)
            end = end_positions.clamp(0, T)
            loss = (F.cross_entropy(start_logits.float(), start, ignore_index=T)
                    + F.cross_entropy(end_logits.float(), end, ignore_index=T)) / 2
        return QuestionAnsweringOutput(loss, start_logits, end_logits)


class BertForMultipleChoice(BertPreTrainedModel):
    """Each (context, choice) pair scored by pooled [CLS] -> linear -> one logit; softmax over choices."""

    hf_architecture = "BertForMultipleChoice"
    looks_up_words = True

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.init_weights()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None) -> TaskOutput:
        """input_ids, token_type_ids, attention_mask (B, C, T); labels (B,) index of the right choice."""
        B, C, T = input_ids.shape

        def flat(t):
            return t.reshape(B * C, T) if t is not None else None

        pooled = self.bert(flat(input_ids), flat(token_type_ids), flat(attention_mask), cls_only=True).pooled_output
        logits = self.classifier(self.dropout(pooled)).view(B, C)  # (B, C)
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return TaskOutput(loss, logits)


MODEL_CLASSES: dict[str, type[BertPreTrainedModel]] = {
    cls.hf_architecture: cls
    for cls in (BertModel, BertForPreTraining, BertForMaskedLM, BertForSequenceClassification,
                BertForTokenClassification, BertForQuestionAnswering, BertForMultipleChoice)
}
