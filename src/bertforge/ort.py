"""ONNX Runtime as the engine behind `Predictor` and `Encoder` (`bertforge predict/embed --backend onnx`), and the
sessions of exported graphs (`session`, `run_session`), which tests and bench/inference.py run too.

    bertforge export --format onnx --model runs/sst2 --out runs/sst2-onnx
    bertforge predict --model runs/sst2-onnx --backend onnx --input texts.jsonl
    bertforge predict --model runs/sst2 --backend onnx --quantize int8 --input texts.jsonl   # exported on the fly
    bertforge embed --model runs/mini --backend onnx --input texts.txt --out vectors.npy

The model is an exported directory (model.onnx beside the model directory's config, task and tokenizer files)
or a PyTorch model directory, which is exported to a temporary directory first (a few seconds): its task model
for `predict`, its encoder for `embed` (a fine-tuned directory's encoder too).
`quantize="int8"` runs ONNX Runtime's dynamic quantization on the fp32 graph (int8 weights per output channel,
8-bit activations per batch), as bench/inference.py's int8 peer does. Tokenizing, batching and decoding are
bertforge's own, so the results have the same form as the PyTorch engine's. ONNX Runtime runs one batch at a
time on the CPU, on torch's thread count. Where it is the faster choice: docs/benchmarks.md (on the AVX512 EPYC
we measure on, one text at a time; over a file bertforge's own engine was faster).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from bertforge.errors import BertforgeError
from bertforge.export import export_onnx, require, write_onnx
from bertforge.tasks.runner import MODEL_INPUTS, load_encoder

ONNX_FILE = "model.onnx"


def session(path: str | Path, *, threads: int | None = None):
    """An onnxruntime InferenceSession on the CPU for an exported model (`threads`: its intra-op threads;
    default onnxruntime's choice)."""
    ort = require("onnxruntime")
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_session(sess, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
                attention_mask: torch.Tensor) -> dict[str, object]:
    """Run an exported model on one batch; {output name: numpy array}."""
    if token_type_ids is None:
        token_type_ids = torch.zeros_like(input_ids)
    inputs = (input_ids, token_type_ids, attention_mask)
    feed = {name: tensor.cpu().numpy() for name, tensor in zip(MODEL_INPUTS, inputs, strict=True)}
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed), strict=True))


class OrtModel(nn.Module):
    """An ONNX Runtime session behind a task model's forward: (B, T) int64 inputs in, an object with the task
    model's output names (`logits`, or `start_logits` and `end_logits`) as CPU tensors out."""

    def __init__(self, onnx_path: Path, threads: int):
        super().__init__()
        self.session = session(onnx_path, threads=threads)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        outputs = run_session(self.session, input_ids, token_type_ids, attention_mask)
        return SimpleNamespace(**{name: torch.from_numpy(array) for name, array in outputs.items()})


class OrtEncoder(OrtModel):
    """An exported encoder's session behind `BertModel`'s forward as `Encoder` calls it: `sequence_output` and
    `pooled_output` (None without a trained pooler) as CPU tensors. `pooler` is None when the graph has none."""

    def __init__(self, onnx_path: Path, threads: int):
        super().__init__(onnx_path, threads)
        names = [o.name for o in self.session.get_outputs()]
        if "last_hidden_state" not in names:
            raise BertforgeError(f"{onnx_path} is a task model's graph ({', '.join(names)}), not an encoder's: "
                                 "pass the PyTorch model directory, which embed exports as an encoder")
        self.pooler = True if "pooler_output" in names else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cls_only: bool = False) -> SimpleNamespace:
        out = super().forward(input_ids, None, attention_mask)
        return SimpleNamespace(sequence_output=out.last_hidden_state, pooled_output=getattr(out, "pooler_output", None))


def quantize_int8_onnx(fp32: Path, int8: Path) -> None:
    """ONNX Runtime's dynamic int8 quantization of the graph `fp32` into `int8`: what `--backend onnx --quantize
    int8` runs, and bench/inference.py's ONNX Runtime int8 peer."""
    require("onnx")
    require("onnxruntime")
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.disable(logging.WARNING)  # the quantizer logs advice on preprocessing for image models to the root logger
    try:
        # per-channel weights: on the bench's MiniLM, Rotten Tomatoes dev / test 77.98 / 79.82 against 76.76 / 78.68
        # per tensor (fp32: 78.08 / 79.82), at the same speed (1,182 against 1,157 texts/s). DefaultTensorType: the
        # fused operators of ONNX Runtime's optimizer (com.microsoft) carry no type information; their outputs are fp32
        quantize_dynamic(fp32, int8, weight_type=QuantType.QInt8, per_channel=True,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        logging.disable(logging.NOTSET)


def load_ort_model(path: Path, quantize: str | None, *, encoder: bool = False) -> OrtModel | OrtEncoder:
    """The session of an exported directory `path` (model.onnx) or of a model directory exported here (its task
    model, or with `encoder` its encoder), int8-quantized by ONNX Runtime if `quantize` is "int8". The session
    holds the graph in memory, so the temporary files are gone when this returns."""
    require("onnxruntime")
    with tempfile.TemporaryDirectory(prefix="bertforge-onnx-") as tmp:
        graph = path / ONNX_FILE
        if not graph.is_file() and encoder:
            graph = write_onnx(load_encoder(path), "encoder", Path(tmp) / ONNX_FILE)
        elif not graph.is_file():
            graph = export_onnx(path, Path(tmp) / ONNX_FILE)  # its errors name a directory that is no model
        if quantize == "int8":
            quantize_int8_onnx(graph, Path(tmp) / "model.int8.onnx")
            graph = Path(tmp) / "model.int8.onnx"
        return (OrtEncoder if encoder else OrtModel)(graph, torch.get_num_threads())
