"""ELECTRA's models (Clark et al. 2020): a small masked-LM generator and the discriminator, a BERT encoder with a
replaced-token head, sharing one embedding module (token, position and segment tables and their LayerNorm, as the
paper's tied embeddings share the whole `electra/embeddings` scope).

The generator is narrower than the discriminator (`generator_config`): it reads the shared embeddings of width E (the
discriminator's H) through a projection E -> G, and its masked-LM head maps G back to E before the tied decoder.
With G == E there is no projection, and the generator is exactly a `BertForMaskedLM`.

Shapes: B batch, T tokens, H discriminator width (= E, the embeddings'), G generator width, V vocabulary, M masked
positions (row-major: batch, then position). Labels use -100 where nothing is predicted.

A run directory (`ElectraForPreTraining.save_pretrained`) holds the discriminator as the model (config.json and
model.safetensors of a `BertModel`, which transformers loads), the replaced-token head beside it (`HEAD_FILE`), and
the generator in `GENERATOR_DIR/`, a masked-LM model directory that fill-mask uses.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from bertforge.config import BertConfig
from bertforge.encoder import (
    BertEmbeddings,
    BertEncoder,
    BertModel,
    BertPreTrainedModel,
    activation,
    attention_mask_for_sdpa,
)
from bertforge.files import atomic_path
from bertforge.model_files import load_state, read_weights
from bertforge.models import (
    IGNORE_INDEX,
    BertForMaskedLM,
    BertLMPredictionHead,
    MaskedLMOutput,
    masked_lm,
    mlm_positions,
)

GENERATOR_DIR = "generator"
HEAD_FILE = "replaced_token_head.safetensors"
EMBEDDING_SIZE = "embedding_size"  # config.json key of a generator narrower than its embeddings


def embedding_size(config: BertConfig) -> int:
    return int(config.extra.get(EMBEDDING_SIZE, config.hidden_size))


def generator_config(config: BertConfig, width: float, layers: float) -> BertConfig:
    """The generator's config for a discriminator of `config`: `width` and `layers` shares of its hidden size and
    depth (rounded, at least 1), a feed-forward of 4x its width, and a head per 64 of width (the reference code's
    rule; fewer when 64 does not divide it)."""
    hidden = max(1, round(config.hidden_size * width))
    heads = max(1, hidden // 64)
    while hidden % heads:
        heads -= 1
    extra = dict(config.extra)
    extra.pop(EMBEDDING_SIZE, None)
    if hidden != config.hidden_size:
        extra[EMBEDDING_SIZE] = config.hidden_size
    return config.replace(hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden,
                          num_hidden_layers=max(1, round(config.num_hidden_layers * layers)), extra=extra,
                          architectures=None)


class GeneratorEncoder(nn.Module):
    """Embeddings of width E, projected to the generator's width G when they differ, then its layers."""

    def __init__(self, config: BertConfig):
        super().__init__()
        E, G = embedding_size(config), config.hidden_size
        self.embeddings = BertEmbeddings(config.replace(hidden_size=E, num_attention_heads=1))
        self.embeddings_project = nn.Linear(E, G) if E != G else None
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, E)
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)  # (B, T, G)
        return self.encoder(x, attention_mask_for_sdpa(attention_mask), positions)


class _Heads(nn.Module):
    def __init__(self, predictions: nn.Module):
        super().__init__()
        self.predictions = predictions


class ElectraGenerator(BertPreTrainedModel):
    """The generator: a masked-LM whose head maps G to E (dense, activation, LayerNorm) before the tied decoder.
    Its parameter names are `BertForMaskedLM`'s, plus `bert.embeddings_project.*` when G != E (transformers' BERT
    classes have no such projection: it loads the generator only when G == E)."""

    hf_architecture = "BertForMaskedLM"

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = GeneratorEncoder(config)
        E = embedding_size(config)
        head = BertLMPredictionHead(config.replace(hidden_size=E, num_attention_heads=1))  # LayerNorm(E), bias (V,)
        head.transform.dense = nn.Linear(config.hidden_size, E)  # G -> E, as the reference's head does
        self.cls = _Heads(head)
        self.init_weights()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None) -> MaskedLMOutput:
        """As `BertForMaskedLM.forward`: with labels, logits (M, V) at the labelled positions and their mean loss."""
        positions = None
        if labels is not None:
            positions, labels = mlm_positions(labels)
        x = self.bert(input_ids, token_type_ids, attention_mask, positions)
        logits, loss = masked_lm(self.cls.predictions, self.bert.embeddings.word_embeddings, x, labels)
        return MaskedLMOutput(loss, logits)


def masked_lm_class(config: BertConfig) -> type[BertPreTrainedModel]:
    """The class that loads a masked-LM directory of `config`: ELECTRA's generator when it is narrower than its
    embeddings, else `BertForMaskedLM`."""
    return ElectraGenerator if EMBEDDING_SIZE in config.extra else BertForMaskedLM


def generator_of(path: str | Path) -> Path:
    """The generator directory of an ELECTRA run directory (saying so on stderr), else `path` itself."""
    path = Path(path)
    if (path / HEAD_FILE).is_file() and (path / GENERATOR_DIR / "config.json").is_file():
        print(f"{path} is an ELECTRA run (its discriminator has no masked-LM head): using its generator, "
              f"{path / GENERATOR_DIR}", file=sys.stderr)
        return path / GENERATOR_DIR
    return path


class ReplacedTokenHead(nn.Module):
    """dense -> activation -> one logit per position: > 0 means "replaced"."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = activation(config.hidden_act)
        self.prediction = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.prediction(self.act(self.dense(hidden))).squeeze(-1)  # (B, T)


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` (M, V), drawn from its softmax by inverting the cumulative distribution at
    `uniforms` (M,) in (0, 1): the same uniforms give the same tokens, on any device and in any process."""
    cdf = logits.float().softmax(-1).cumsum(-1)  # (M, V)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # (M, 1)
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_max(logits.shape[-1] - 1)


def corrupt(input_ids: torch.Tensor, mlm_labels: torch.Tensor, sampled: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The discriminator's input and labels: the original sequence (the masked positions' labels put back) with the
    samples (M,) at the masked positions, row-major; replaced (B, T) bool is True where the token differs from the
    original (a sample equal to the original counts as original)."""
    selected = mlm_labels != IGNORE_INDEX  # (B, T)
    original = torch.where(selected, mlm_labels, input_ids)
    corrupted = original.masked_scatter(selected, sampled.to(original.dtype))
    return corrupted, corrupted != original


def replaced_token_loss(logits: torch.Tensor, replaced: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of the replaced-token logits (B, T) over the non-padding positions."""
    weights = attention_mask.to(logits.device).float()
    losses = F.binary_cross_entropy_with_logits(logits.float(), replaced.float(), reduction="none")
    return (losses * weights).sum() / weights.sum().clamp_min(1)


@dataclass
class ElectraOutput:
    mlm_loss: torch.Tensor  # the generator's mean cross-entropy over the masked positions
    rtd_loss: torch.Tensor  # the discriminator's mean binary cross-entropy over the non-padding positions
    mlm_logits: torch.Tensor  # (M, V) the generator's, at the masked positions
    rtd_logits: torch.Tensor  # (B, T) the discriminator's, > 0: replaced
    replaced: torch.Tensor  # (B, T) bool, the discriminator's labels
    sampled: torch.Tensor  # (M,) the generator's samples at the masked positions


class ElectraForPreTraining(BertPreTrainedModel):
    """The generator and the discriminator, trained together; `generator.bert.embeddings` *is*
    `discriminator.embeddings`. `forward` computes both losses; `save_pretrained` writes the run directory layout."""

    hf_architecture = "BertModel"

    def __init__(self, config: BertConfig, generator: BertConfig):
        super().__init__()
        self.config = config
        # no pooler: nothing trains it here (fine-tuning initialises one), and DDP refuses parameters without gradients
        self.discriminator = BertModel(config, add_pooling_layer=False)
        self.generator = ElectraGenerator(generator)
        if embedding_size(generator) != config.hidden_size:
            raise ValueError(f"the generator's embeddings are {embedding_size(generator)} wide, the discriminator's "
                             f"{config.hidden_size}: make its config with generator_config")
        self.generator.bert.embeddings = self.discriminator.embeddings  # the tying: one module, both models
        self.head = ReplacedTokenHead(config)
        self.head.apply(self._init_module)

    def forward(self, input_ids, token_type_ids, attention_mask, mlm_labels, uniforms) -> ElectraOutput:
        """mlm_labels (B, T): the original ids at the masked positions, -100 elsewhere; uniforms (B, T) in (0, 1):
        the draw of each masked position's sample (`sample_tokens`)."""
        gen = self.generator(input_ids, token_type_ids, attention_mask, labels=mlm_labels)
        selected = mlm_labels != IGNORE_INDEX
        with torch.no_grad():  # the samples carry no gradient to the generator
            sampled = sample_tokens(gen.logits.detach(), uniforms[selected])
            corrupted, replaced = corrupt(input_ids, mlm_labels, sampled)
        hidden = self.discriminator(corrupted, token_type_ids, attention_mask).sequence_output  # (B, T, H)
        logits = self.head(hidden)
        return ElectraOutput(gen.loss, replaced_token_loss(logits, replaced, attention_mask), gen.logits, logits,
                             replaced, sampled)

    def save_pretrained(self, path) -> None:
        """The discriminator as the model in `path`, its head in HEAD_FILE, the generator in GENERATOR_DIR/."""
        path = Path(path)
        self.discriminator.save_pretrained(path)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.head.state_dict().items()}
        with atomic_path(path / HEAD_FILE) as tmp:
            safetensors.torch.save_file(state, tmp, metadata={"format": "pt"})
        self.generator.save_pretrained(path / GENERATOR_DIR)

    def read_weights(self, path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors of a directory `save_pretrained` wrote, by part (a checkpoint's, for `load_weights`)."""
        path = Path(path)
        return {"discriminator": read_weights(path), "head": read_weights(path / HEAD_FILE),
                "generator": read_weights(path / GENERATOR_DIR)}

    def load_weights(self, weights: dict[str, dict[str, torch.Tensor]], source: str = "checkpoint") -> None:
        load_state(self.generator, weights["generator"], source=f"{source}/{GENERATOR_DIR}", verbose=False)
        load_state(self.discriminator, weights["discriminator"], source=source, verbose=False)
        self.head.load_state_dict(weights["head"])
