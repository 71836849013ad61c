"""The engines one model directory is served with, and which endpoints they give: a fine-tuned directory (with
task.json) `/predict` (`Predictor`), a pretrained one with its masked-LM head `/fill-mask` (`MaskFiller`), any
one `/embed` (`Encoder`). They are the engines `bertforge predict`, `fill-mask` and `embed` run, with the same
`EngineOptions`, so the server answers what those commands print."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bertforge.config import BertConfig
from bertforge.errors import BertforgeError
from bertforge.infer import Encoder, MaskFiller, Predictor
from bertforge.model_files import model_dir
from bertforge.options import DEFAULT_WINDOWS, EngineOptions
from bertforge.tasks.runner import TASK_FILE

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.onnx")
CHARS_PER_TOKEN = 4  # English text averages about 4 characters a WordPiece token; the batcher's budget estimates


def group_batch_size(inputs: int) -> int:
    """The batch size that cuts a served group of `inputs` into 4 length-sorted batches (up to `predict`'s 64 a
    batch), which a CPU runs two at a time on a thread each (`bertforge.batching`). A group of concurrent requests is
    a random draw of lengths; the packed encoder (`bertforge.infer.packing`) computes no padding but in the attention,
    the fused one (`bertforge.infer.fused`, fp32 and int8 where the kernels load) each sorted batch as padded, so the
    cut trades padding against the fixed cost of each batch. (Groups of 32 Rotten Tomatoes snippets, a 2-core Xeon
    with AMX: fp32 fused against packed 1.01x for MiniLM-L6, 1.25x for BERT-tiny, the same groups alternating.)
    bench/serve.py, MiniLM-L6, 32 clients, 2-core EPYC with AVX512-BF16, side by side alone (docs/benchmarks.md,
    twelfth session):
    cut in 4 against 8, fp32 272.5-276.2 against 251.8-267.3 requests/s, bf16 408.3 and 442.0 against 348.8 and
    360.1, int8 556.5 and 587.5 against 515.6 and 568.1; offline (`--cuts`), fp32 283-301 against 256-280 texts/s.
    Cut in 2 (or 1) a group runs as one stream on both threads, which lost in bf16 (296.9 and 301.9 requests/s
    against 343.4 and 358.8 cut in 8)."""
    return max(1, min(64, -(-inputs // 4)))


@dataclass
class ServedModel:
    """A model directory loaded for serving. `run` is the batcher's runner: (key, items) -> a result per item."""

    path: Path
    options: EngineOptions
    predictor: Predictor | None = None
    filler: MaskFiller | None = None
    encoder: Encoder | None = None
    missing: dict[str, str] = field(default_factory=dict)  # endpoint -> why this model does not serve it

    @classmethod
    def load(cls, path: str | Path, options: EngineOptions | None = None) -> ServedModel:
        path, options = model_dir(path), options or EngineOptions()
        served = cls(path, options)
        if (path / TASK_FILE).is_file():
            served.predictor = Predictor(path, options)
            served.missing["/fill-mask"] = "a fine-tuned model has no masked-LM head"
        else:
            served.missing["/predict"] = f"a pretrained model has no task head (no {TASK_FILE})"
            try:  # ONNX Runtime runs encoders and task heads; the masked-LM head runs on bertforge's engine, in fp32
                served.filler = MaskFiller(path, options if options.backend == "torch" else
                                           dataclasses.replace(options, backend="torch", precision="fp32"))
            except BertforgeError as e:
                served.missing["/fill-mask"] = str(e)
        if served.predictor is not None and options.backend == "torch":  # the task model's encoder, not a second copy
            task_model = served.predictor.task_model
            served.encoder = Encoder.sharing(task_model.model.bert, task_model.tokenizer)
        else:
            served.encoder = Encoder(path, options)
        return served

    @property
    def endpoints(self) -> list[str]:
        return [name for name, engine in (("/predict", self.predictor), ("/fill-mask", self.filler),
                                          ("/embed", self.encoder)) if engine is not None]

    @property
    def task(self) -> Any:
        return None if self.predictor is None else self.predictor.task

    @property
    def max_length(self) -> int:
        if self.predictor is not None:
            return self.predictor.task_model.max_length
        return self.encoder.max_length

    def cost(self, items: list) -> int:
        """Estimated tokens of `items` (texts, or predict's records), each counted up to the model's max length, or
        up to its windows' for a single text that a classifier reads in windows (`Predictor.predict`)."""
        windowed = self.task is not None and self.task.kind in ("classification", "regression")

        def tokens(item: Any) -> int:
            if isinstance(item, str):
                return min(self.max_length, len(item) // CHARS_PER_TOKEN + 2)
            choices = item.get("choices") or []
            text = sum(len(v) for k, v in item.items() if isinstance(v, str))
            if choices:  # the context once per choice
                return sum(min(self.max_length, (text + len(c)) // CHARS_PER_TOKEN + 3) for c in choices)
            most = DEFAULT_WINDOWS if windowed and not item.get("text_pair") else 1
            return min(most * self.max_length, text // CHARS_PER_TOKEN + 3)

        return sum(tokens(item) for item in items)

    def run(self, key: Hashable, items: list) -> list:
        endpoint, *options = key
        if endpoint == "/predict":
            return self.predictor.predict(items, batch_size=group_batch_size(len(items)))
        if endpoint == "/fill-mask":
            (top_k,) = options
            return self.filler.fill(items, top_k=top_k)
        pooling, normalize = options
        return self.encoder.embed(items, pooling=pooling, normalize=normalize).tolist()

    def info(self) -> dict[str, Any]:
        config = BertConfig.from_json(self.path)
        task = self.task
        return {
            "model": str(self.path),
            "kind": task.kind if task is not None else "pretrained",
            "task": task.name if task is not None else None,
            "labels": list(task.labels) if task is not None and task.labels else None,
            "endpoints": self.endpoints,
            "engine": self.options.backend,
            "precision": self.options.precision,
            "quantize": self.options.quantize,
            "device": self.options.device or "auto",
            "max_length": self.max_length,
            "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers,
            "weights_bytes": sum((self.path / f).stat().st_size for f in WEIGHT_FILES if (self.path / f).is_file()),
            "pooler": self.encoder.model.pooler is not None,  # whether /embed takes pooling "pooler"
        }
