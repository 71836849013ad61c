"""Export a model directory to ONNX, for ONNX Runtime and other engines.

    bertforge export --format onnx --model runs/sst2 --out runs/sst2-onnx     # a directory: model.onnx + files
    bertforge export --format onnx --model runs/mini --out mini.onnx           # just the graph

What is exported, by the directory's kind (a fine-tuned directory has task.json; any other is an encoder):

    encoder                 -> last_hidden_state (B, T, H), pooler_output (B, H) (when the pooler was trained)
    classification (and regression), token classification -> logits (B, C) or (B, T, C)
    question answering      -> start_logits (B, T), end_logits (B, T)

Inputs are input_ids, token_type_ids and attention_mask, each (B, T) int64, with B and T dynamic (T at most
max_position_embeddings). The PyTorch model is unchanged: the graph is traced from its own forward, on a batch
with padding, so the traced attention always applies the mask (the eager model drops an all-ones mask only as
a shortcut with the same result). onnx and onnxruntime come with `pip install bertforge[onnx]`.
"""

from __future__ import annotations

import importlib
import json
import shutil
import warnings
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from bertforge.errors import BertforgeError
from bertforge.files import atomic_dir, atomic_path
from bertforge.model_files import model_dir as as_model_dir
from bertforge.tasks.runner import MODEL_INPUTS, TASK_FILE, load_encoder, load_task_model

OPSET = 17  # the first opset with a LayerNormalization operator
# Files of a model directory copied next to model.onnx, so the exported directory carries its tokenizer.
SIDE_FILES = ("config.json", "task.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json")


def require(module: str) -> ModuleType:
    """Import onnx or onnxruntime, or say how to install them (for `bertforge.ort` too)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise BertforgeError(f"{module} is not installed: run `pip install bertforge[onnx]` "
                             "(or `pip install onnx onnxruntime`)") from None


class _Traceable(nn.Module):
    """The model's forward with plain tensors in and a tuple of tensors out, for the tracer."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model = model
        self.kind = kind

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.model(input_ids, token_type_ids, attention_mask)
        if self.kind == "encoder":
            return (out.sequence_output,) if out.pooled_output is None else (out.sequence_output, out.pooled_output)
        if self.kind == "question_answering":
            return out.start_logits, out.end_logits
        return (out.logits,)


def output_names(model: nn.Module, kind: str) -> list[str]:
    if kind == "encoder":
        return ["last_hidden_state"] + (["pooler_output"] if model.pooler is not None else [])
    if kind == "question_answering":
        return ["start_logits", "end_logits"]
    return ["logits"]


def example_inputs(config, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of 8 tokens, the second padded after 5 and with a second segment: the tracer must see padding
    (see the module docstring) and segment B."""
    T = min(8, config.max_position_embeddings)
    ids = torch.arange(T).repeat(2, 1) % config.vocab_size
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 5:] = 0
    ids[1, 5:] = config.pad_token_id
    types = torch.zeros(2, T, dtype=torch.long)
    if config.type_vocab_size > 1:
        types[:, T // 2:] = 1
    return ids.to(device), types.to(device), mask.to(device)


def write_onnx(model: nn.Module, kind: str, path: str | Path, *, opset: int = OPSET) -> Path:
    """Trace `model` (eval mode, CPU) and write its ONNX graph to `path`, atomically."""
    onnx = require("onnx")
    model = model.eval().cpu()
    names = output_names(model, kind)
    axes = {name: {0: "batch", 1: "tokens"} for name in MODEL_INPUTS}
    axes.update({name: {0: "batch"} if name == "pooler_output" or (kind == "classification" and name == "logits")
                 else {0: "batch", 1: "tokens"} for name in names})
    with atomic_path(path) as tmp, torch.no_grad(), warnings.catch_warnings():
        # The tracer warns about Python-level branches on tensor values (the length check, the all-ones mask
        # shortcut); the example has padding, so the masked path is the one traced, which is right for any input.
        warnings.simplefilter("ignore")
        # An eval-mode wrapper: the exporter restores the wrapper's mode afterwards, and a new module is in
        # training mode, which would switch dropout on in the caller's model.
        torch.onnx.export(_Traceable(model, kind).eval(), example_inputs(model.config), str(tmp), dynamo=False,
                          input_names=list(MODEL_INPUTS), output_names=names, dynamic_axes=axes, opset_version=opset)
        onnx.checker.check_model(str(tmp))
    return Path(path)


def load_for_export(model_dir: str | Path) -> tuple[nn.Module, str]:
    """(model, kind) of a model directory: the task model of a fine-tuned one, else its encoder."""
    model_dir = as_model_dir(model_dir)
    if (model_dir / TASK_FILE).is_file():
        tm = load_task_model(model_dir, device="cpu")
        kind = tm.task.kind
        if kind == "multiple_choice":
            raise BertforgeError("multiple-choice models cannot be exported yet (their inputs are (B, choices, T)); "
                                 "export the encoder of a pretrained directory instead")
        return tm.model, "classification" if kind == "regression" else kind
    return load_encoder(model_dir), "encoder"


def export_onnx(model_dir: str | Path, out: str | Path, *, opset: int = OPSET) -> Path:
    """Export `model_dir` to `out`: a .onnx file, or a directory holding model.onnx and the model directory's
    config, task and tokenizer files. Returns the path of the .onnx file."""
    model_dir, out = Path(model_dir), Path(out)
    model, kind = load_for_export(model_dir)
    if out.suffix == ".onnx":
        return write_onnx(model, kind, out, opset=opset)
    if out.resolve() == model_dir.resolve():
        raise BertforgeError(f"--out {out} is the model directory itself: pass a new directory or a .onnx file")
    with atomic_dir(out) as tmp:
        write_onnx(model, kind, tmp / "model.onnx", opset=opset)
        for name in SIDE_FILES:
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, tmp / name)
        (tmp / "onnx.json").write_text(json.dumps({"kind": kind, "inputs": list(MODEL_INPUTS),
                                                   "outputs": output_names(model, kind), "opset": opset}) + "\n")
    return out / "model.onnx"
