"""Model directories: `config.json` + `model.safetensors` with Hugging Face parameter names.

The one name map between our module tree and the Hugging Face one lives here (`LAYER_NAME_MAP`). Loading
accepts our directories, Hugging Face ones (`model.safetensors` or `pytorch_model.bin`, the latter through
`torch.load(weights_only=True)`, which never runs code), base-model-only files without the `bert.` prefix,
Google-converted names (`LayerNorm.gamma`/`beta`) and DDP / torch.compile prefixes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from bertforge.config import BertConfig
from bertforge.errors import BertforgeError
from bertforge.files import atomic_path

WEIGHTS_NAME = "model.safetensors"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"

# Our name (under `encoder.layer.{i}.`) -> the Hugging Face name(s) it holds; several are concatenated
# along dim 0 in the order given. Every other parameter has the same name in both layouts.
LAYER_NAME_MAP: dict[str, tuple[str, ...]] = {
    "attention.qkv.weight": ("attention.self.query.weight", "attention.self.key.weight",
                             "attention.self.value.weight"),
    "attention.qkv.bias": ("attention.self.query.bias", "attention.self.key.bias", "attention.self.value.bias"),
    "attention_out.weight": ("attention.output.dense.weight",),
    "attention_out.bias": ("attention.output.dense.bias",),
    "attention_norm.weight": ("attention.output.LayerNorm.weight",),
    "attention_norm.bias": ("attention.output.LayerNorm.bias",),
    "intermediate.weight": ("intermediate.dense.weight",),
    "intermediate.bias": ("intermediate.dense.bias",),
    "output.weight": ("output.dense.weight",),
    "output.bias": ("output.dense.bias",),
    "output_norm.weight": ("output.LayerNorm.weight",),
    "output_norm.bias": ("output.LayerNorm.bias",),
}
_HF_TO_OURS = {hf: (ours, i, len(hfs)) for ours, hfs in LAYER_NAME_MAP.items() for i, hf in enumerate(hfs)}

# Heads a checkpoint may carry that another model class has no use for (fine-tuning from a pretraining
# checkpoint drops `cls.*`): dropped with a notice rather than refused.
HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.", "bert.pooler.", "pooler.")
_ENCODER_PREFIXES = ("embeddings.", "encoder.", "pooler.")


def model_dir(path: str | os.PathLike) -> Path:
    """`path` as a model directory; refuses, in one line, a path without a config.json."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise BertforgeError(f"{path} is not a model directory (no config.json): pass the --out directory of "
                             "`bertforge pretrain` or `bertforge finetune`")
    return path


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel) or (
                type(model).__name__ == "DataParallel" and hasattr(model, "module")):
            model = model.module
        else:
            return model


def to_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our state dict under Hugging Face names (q/k/v split out of the fused projection)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in unwrap(model).state_dict().items():
        head, sep, rest = name.partition("encoder.layer.")
        if sep:
            index, _, local = rest.partition(".")
            hf_names = LAYER_NAME_MAP[local]
            for hf, part in zip(hf_names, tensor.chunk(len(hf_names), dim=0), strict=True):
                out[f"{head}encoder.layer.{index}.{hf}"] = part.contiguous()
        else:
            out[name] = tensor.contiguous()
    if "cls.predictions.decoder.weight" in out:  # an untied decoder: transformers reads its bias under its own name
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"].clone()
    return out


def _normalise_name(name: str) -> str | None:
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    name = name.replace("._orig_mod.", ".")
    if name.endswith("position_ids"):
        return None  # a buffer older checkpoints saved; we derive positions
    if "LayerNorm" in name:
        name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
    return name


def from_hf_state_dict(state: dict[str, torch.Tensor], *, with_bert_prefix: bool,
                       untied_decoder: bool = False) -> dict[str, torch.Tensor]:
    """Hugging Face names (any of the accepted variants) -> our names, for a model whose encoder sits under
    `bert.` (`with_bert_prefix`) or at the top (BertModel), and whose masked-LM decoder is a matrix of its own
    (`untied_decoder`) or the word embeddings."""
    renamed: dict[str, torch.Tensor] = {}
    for raw, tensor in state.items():
        name = _normalise_name(raw)
        if name is None:
            continue
        if with_bert_prefix and name.startswith(_ENCODER_PREFIXES):
            name = "bert." + name
        elif not with_bert_prefix and name.startswith("bert."):
            name = name[len("bert."):]
        renamed[name] = tensor

    # A tied decoder is the word embeddings (a copy in the file is dropped); its bias is `cls.predictions.bias`.
    if not untied_decoder:
        renamed.pop("cls.predictions.decoder.weight", None)
    decoder_bias = renamed.pop("cls.predictions.decoder.bias", None)
    if decoder_bias is not None:
        renamed.setdefault("cls.predictions.bias", decoder_bias)

    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in renamed.items():
        head, sep, rest = name.partition("encoder.layer.")
        index, _, local = rest.partition(".")
        if sep and local in _HF_TO_OURS:
            ours, i, n = _HF_TO_OURS[local]
            parts.setdefault(f"{head}encoder.layer.{index}.{ours}", [None] * n)[i] = tensor
        else:
            out[name] = tensor
    for name, pieces in parts.items():
        if any(p is None for p in pieces):
            local = name.partition("encoder.layer.")[2].partition(".")[2]
            absent = [hf for hf, p in zip(LAYER_NAME_MAP[local], pieces, strict=True) if p is None]
            raise BertforgeError(f"checkpoint is missing {', '.join(absent)} for {name}; the file is "
                                 f"incomplete or not a BERT checkpoint")
        out[name] = torch.cat(pieces, dim=0)  # type: ignore[arg-type]
    return out


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The raw tensors of a model directory or weights file. Never executes code from the file."""
    path = Path(path)
    if path.is_dir():
        for name in (WEIGHTS_NAME, LEGACY_WEIGHTS_NAME):
            if (path / name).is_file():
                path = path / name
                break
        else:
            index = path / f"{WEIGHTS_NAME}.index.json"
            if index.is_file():
                state: dict[str, torch.Tensor] = {}
                for f in _indexed_files(index):
                    state.update(read_weights(path / f))
                return state
            raise BertforgeError(f"no {WEIGHTS_NAME} or {LEGACY_WEIGHTS_NAME} in {path}; point to a model "
                                 f"directory written by save_pretrained or a Hugging Face BERT directory")
    if not path.is_file():
        raise BertforgeError(f"weights file {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            return safetensors.torch.load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except BertforgeError:
        raise
    except Exception as e:  # a corrupt or foreign file: say which, not where in the parser it broke
        raise BertforgeError(f"cannot read weights from {path} ({type(e).__name__}: {str(e)[:200]}); "
                             f"the file is corrupt or not a PyTorch/safetensors checkpoint") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BertforgeError(f"{path} does not hold a flat dictionary of tensors; is it a training "
                             f"checkpoint rather than a model? Load the model directory instead")
    return state


def _indexed_files(index: Path) -> list[str]:
    """The weight files a sharded checkpoint's index names, each refused unless it lies inside the index's
    directory: a downloaded index must not make us read `../../elsewhere` or `/absolute/path`. The names are
    resolved as written, not through symlinks, so a Hugging Face cache snapshot (files linking to ../blobs)
    still loads."""
    try:
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BertforgeError(f"{index} is not a weights index (JSON with a \"weight_map\" of tensor name to "
                             f"file name); repair or remove it") from None
    home = os.path.normpath(index.parent.absolute())
    for f in files:
        target = os.path.normpath(os.path.join(home, str(f)))
        if target == home or os.path.commonpath([home, target]) != home:
            raise BertforgeError(f"{index} names the weight file {f!r}, outside {index.parent}; a model "
                                 f"directory's weights must lie inside it: the index is corrupt or hostile")
    return files


def load_state(model: nn.Module, state: dict[str, torch.Tensor], *, source: str = "checkpoint",
               verbose: bool = True) -> list[str]:
    """Load Hugging Face-named tensors into `model`. Heads the model has but the checkpoint lacks keep
    their fresh initialisation; heads the checkpoint has but the model lacks are dropped. Anything else
    missing, unexpected or mis-shaped raises one BertforgeError that lists it all.
    Returns the names that were initialised fresh."""
    model = unwrap(model)
    expected = model.state_dict()
    ours = from_hf_state_dict(state, with_bert_prefix=hasattr(model, "bert"),
                              untied_decoder="cls.predictions.decoder.weight" in expected)
    missing = [k for k in expected if k not in ours]
    unexpected = [k for k in ours if k not in expected]
    fresh = [k for k in missing if k.startswith(HEAD_PREFIXES)]
    dropped = [k for k in unexpected if k.startswith(HEAD_PREFIXES)]
    problems = [f"missing {k} {tuple(expected[k].shape)}" for k in missing if k not in fresh]
    problems += [f"unexpected {k} {tuple(ours[k].shape)}" for k in unexpected if k not in dropped]
    problems += [f"{k} has shape {tuple(ours[k].shape)} in the checkpoint but {tuple(v.shape)} in the model"
                 for k, v in expected.items() if k in ours and ours[k].shape != v.shape]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise BertforgeError(f"{source} does not fit {type(model).__name__} "
                             f"(L={model.config.num_hidden_layers}, H={model.config.hidden_size}, "
                             f"V={model.config.vocab_size}): {shown}. Check that config.json belongs to "
                             f"these weights and that num_labels matches the task")
    with torch.no_grad():
        for k, v in expected.items():
            if k in ours:
                v.copy_(ours[k])
    if verbose and fresh:
        print(f"{type(model).__name__}: initialised {len(fresh)} weights not in {source} "
              f"({_summarise(fresh)})", file=sys.stderr)
    if verbose and dropped:
        print(f"{type(model).__name__}: ignored {len(dropped)} weights of heads it does not have "
              f"({_summarise(dropped)})", file=sys.stderr)
    return fresh


def _summarise(names: list[str]) -> str:
    roots = sorted({".".join(n.split(".")[:-1][:2]) for n in names})  # module paths, two levels deep
    return ", ".join(r + ".*" for r in roots)


def load_model(cls, path, *, config: BertConfig | None = None, verbose: bool = True,
               **overrides) -> tuple[nn.Module, list[str]]:
    """Build `cls` from a model directory's config.json (or the given config, with `overrides`) and load its
    weights, read once: (model, the names of the weights the checkpoint lacked and the model initialised fresh,
    heads only: `load_state`). `verbose` says on stderr what was initialised or dropped. The one model loader:
    `load_pretrained` (`from_pretrained`) and the inference engines both come here."""
    path = Path(path)
    if not path.exists():
        raise BertforgeError(f"model path {path} does not exist: pass a model directory (the --out directory of "
                             "`bertforge pretrain` or `bertforge finetune`, or a Hugging Face BERT directory)")
    if config is None:
        config = BertConfig.from_json(path if path.is_dir() else path.parent)
    if overrides:
        if "num_labels" in overrides and "id2label" not in overrides and config.id2label is not None \
                and len(config.id2label) != overrides["num_labels"]:
            overrides["id2label"] = None
        config = config.replace(**overrides)
    model = cls(config)
    fresh = load_state(model, read_weights(path), source=str(path), verbose=verbose)
    return model, fresh


def load_pretrained(cls, path, *, config: BertConfig | None = None, verbose: bool = True, **overrides):
    """`load_model`'s model alone: build `cls` from a model directory's config.json (or the given config) and
    load its weights."""
    return load_model(cls, path, config=config, verbose=verbose, **overrides)[0]


def save_pretrained(model: nn.Module, path: str | os.PathLike) -> None:
    """Write config.json and model.safetensors (Hugging Face names), each atomically."""
    model = unwrap(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu") for k, v in to_hf_state_dict(model).items()}
    with atomic_path(path / WEIGHTS_NAME) as tmp:
        safetensors.torch.save_file(state, tmp, metadata={"format": "pt"})
    model.config.replace(architectures=[type(model).hf_architecture]).to_json(path / "config.json")
