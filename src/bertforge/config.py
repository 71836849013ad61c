"""BertConfig: every size and switch of a BERT model, with the paper's presets.

Field names are the Hugging Face BERT `config.json` keys, so a config round-trips through files that
`transformers` writes and reads. Imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.files import read_json_object, write_json

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")

# name: (num_hidden_layers L, hidden_size H, num_attention_heads A); intermediate_size is 4H.
# tiny..medium are the compact models of Turc et al. (2019); base and large are the paper's.
PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}

# Keys that Hugging Face configs carry and we accept as long as they hold the values our model implements.
_ACCEPTED_VALUES = {
    "position_embedding_type": ("absolute",),
    "is_decoder": (False,),
    "add_cross_attention": (False,),
}


class ConfigError(BertforgeError, ValueError):
    """An impossible configuration value (a ValueError, so callers may catch either)."""


@dataclass
class BertConfig:
    """Sizes and switches of a BERT model. Defaults are BERT-Base, uncased English vocabulary."""

    vocab_size: int = 30522  # V: WordPiece vocabulary size; must equal the tokenizer's
    hidden_size: int = 768  # H: width of every token representation
    num_hidden_layers: int = 12  # L: encoder layers
    num_attention_heads: int = 12  # A: heads per attention layer; H must be a multiple of A
    intermediate_size: int = 3072  # feed-forward inner width, 4H in the paper
    hidden_act: str = "gelu"  # feed-forward activation: "gelu" is the exact erf form BERT used
    hidden_dropout_prob: float = 0.1  # dropout on embeddings and on each sub-layer output
    attention_probs_dropout_prob: float = 0.1  # dropout on attention probabilities
    max_position_embeddings: int = 512  # longest sequence the position table covers
    type_vocab_size: int = 2  # segments: 0 for sentence A, 1 for sentence B
    layer_norm_eps: float = 1e-12  # LayerNorm epsilon (BERT's TF code used 1e-12)
    initializer_range: float = 0.02  # std of the N(0, std) init of weight matrices
    pad_token_id: int = 0  # [PAD]: its word embedding gets no gradient
    classifier_dropout: float | None = None  # dropout before task classifiers; None -> hidden_dropout_prob
    num_labels: int = 2  # task head outputs; 1 means regression for sequence classification
    id2label: dict[int, str] | None = None  # label names of a task model, in output order
    task: str | None = None  # bertforge task name of a fine-tuned model (e.g. "sst2"), or None
    # Pre-LN layers (x + Attn(LN(x)), then a final LayerNorm) instead of BERT's post-LN; an option of the budget
    # recipe. transformers' BertModel has no such layer: such checkpoints load in bertforge only.
    pre_layer_norm: bool = False
    # The masked-LM decoder: the word embedding matrix (True, BERT's tying), or a matrix of its own (False; the
    # key transformers reads too). Untied, the softmax's push on words that are not the target moves the decoder's
    # rows, not the input embeddings (issue 48: tied, a short run's rare-word embeddings collapse together).
    tie_word_embeddings: bool = True
    architectures: list[str] | None = None  # Hugging Face class name(s) the weights belong to
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # other keys, kept for round trips

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size", "num_labels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config {name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"config hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; choose a head count that divides the hidden size")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"config hidden_act={self.hidden_act!r} is not supported; use one of {ACTIVATIONS}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not (0.0 <= value < 1.0):
                raise ConfigError(f"config {name}={value!r} must be in [0, 1)")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"config layer_norm_eps={self.layer_norm_eps!r} must be > 0")
        if not self.initializer_range > 0:
            raise ConfigError(f"config initializer_range={self.initializer_range!r} must be > 0")
        if self.pad_token_id is not None and not (0 <= self.pad_token_id < self.vocab_size):
            raise ConfigError(f"config pad_token_id={self.pad_token_id!r} is outside the vocabulary "
                              f"(vocab_size={self.vocab_size})")
        if self.id2label is not None:
            try:
                self.id2label = {int(k): str(v) for k, v in dict(self.id2label).items()}
            except (TypeError, ValueError):
                raise ConfigError(f"config id2label={self.id2label!r} must map the ids 0..n-1 to label "
                                  f"names") from None
            if sorted(self.id2label) != list(range(len(self.id2label))):
                raise ConfigError(f"config id2label keys {sorted(self.id2label)} must be 0..n-1")
            if len(self.id2label) != self.num_labels and self.num_labels != 1:
                raise ConfigError(f"config id2label has {len(self.id2label)} labels but num_labels="
                                  f"{self.num_labels}")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def labels(self) -> list[str] | None:
        if self.id2label is None:
            return None
        return [self.id2label[i] for i in range(len(self.id2label))]

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> BertConfig:
        """`tiny`, `mini`, `small`, `medium`, `base` or `large`; keyword arguments override any field."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        layers, hidden, heads = PRESETS[name]
        sizes = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     intermediate_size=4 * hidden)
        return cls(**{**sizes, **overrides})

    def replace(self, **changes: Any) -> BertConfig:
        return dataclasses.replace(self, **changes)

    # --- Hugging Face config.json -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"model_type": "bert"}
        if self.architectures:
            d["architectures"] = list(self.architectures)
        for f in dataclasses.fields(self):
            if f.name in ("extra", "architectures", "id2label", "task") or (
                    f.name in ("pre_layer_norm", "tie_word_embeddings") and getattr(self, f.name) == f.default):
                continue
            d[f.name] = getattr(self, f.name)
        if self.id2label is not None:
            d["id2label"] = {str(i): label for i, label in self.id2label.items()}
            d["label2id"] = {label: i for i, label in self.id2label.items()}
        if self.task is not None:
            d["bertforge_task"] = self.task
        d["position_embedding_type"] = "absolute"
        for key, value in self.extra.items():
            d.setdefault(key, value)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> BertConfig:
        d = dict(d)
        model_type = d.pop("model_type", "bert")
        if model_type != "bert":
            raise ConfigError(f"{source}: model_type {model_type!r} is not a BERT model; bertforge loads "
                              f"model_type 'bert' checkpoints only")
        for key, allowed in _ACCEPTED_VALUES.items():
            if key in d and d[key] not in allowed:
                raise ConfigError(f"{source}: {key}={d[key]!r} is not supported (only {allowed[0]!r})")
        d.pop("label2id", None)
        if "bertforge_task" in d:
            d["task"] = d.pop("bertforge_task")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k not in _ACCEPTED_VALUES}
        if isinstance(known.get("id2label"), dict) and "num_labels" not in known:
            known["num_labels"] = len(known["id2label"])
        try:
            return cls(**known, extra=extra)
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_json(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> BertConfig:
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        fix = "point to a model directory written by `save_pretrained` (or a Hugging Face BERT directory)"
        d = read_json_object(path, what="BERT settings", fix=fix, missing=f"no config.json at {path}; {fix}",
                             error=ConfigError)
        return cls.from_dict(d, source=path)
