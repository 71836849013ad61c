"""The sides bench/inference.py compares, each answering `file(texts)` (a whole file, length-sorted batches) and
`one(text)` (a single text) with class probabilities: transformers and ONNX Runtime behind transformers' fast
tokenizer (`HFSide`), and ours, `Predictor.predict` as `bertforge predict` runs it (`OursSide`). What each side is,
and how they are timed: bench/inference.py's docstring."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from bertforge.batching import length_batches, run_batches
from bertforge.errors import BertforgeError
from bertforge.infer import EngineOptions, FusedEncoder, Predictor, packed_linear, transforms
from bertforge.ort import session
from bertforge.tasks.runner import MODEL_INPUTS

MAX_LENGTH = 128  # every side truncates texts to this many tokens
# Our sides besides fp32: their EngineOptions fields; a side this device or CPU cannot run is left out, with the reason.
OURS_NARROW = {"ours bf16": {"precision": "bf16"}, "ours int8": {"quantize": "int8"}}


def sorted_batches(lengths: list[int], size: int) -> list[np.ndarray]:
    """Indices sorted by length, longest first, cut into batches of `size`: the batches `Predictor.predict`
    runs (bertforge.tasks.runner.run_model), from the same function."""
    return list(length_batches(lengths, max_tokens=None, max_batch=size))


def pad_rows(enc, idx: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
    """The rows `idx` of an unpadded transformers encoding, padded to their longest: int64 model inputs."""
    rows = [enc["input_ids"][i] for i in idx]
    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    types = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for r, (i, row) in enumerate(zip(idx, rows, strict=True)):
        ids[r, :len(row)] = row
        types[r, :len(row)] = enc["token_type_ids"][i]
        mask[r, :len(row)] = 1
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class HFSide:
    """transformers' fast tokenizer feeding a model run by `forward(inputs) -> logits array`: the
    transformers and ONNX Runtime sides; `streams` batches at a time (`bertforge.batching.run_batches`)."""

    def __init__(self, tokenizer, forward, batch_size: int, streams: int = 1):
        self.tok, self.forward, self.batch_size, self.streams = tokenizer, forward, batch_size, streams

    def file(self, texts: list[str]) -> np.ndarray:
        enc = self.tok(texts, truncation=True, max_length=MAX_LENGTH)
        parts: list[tuple[np.ndarray, np.ndarray]] = []  # (indices, probabilities) of each batch, as they finish

        def run(idx: np.ndarray) -> None:
            parts.append((idx, softmax(self.forward(pad_rows(enc, idx, self.tok.pad_token_id)))))

        run_batches(run, sorted_batches([len(ids) for ids in enc["input_ids"]], self.batch_size), self.streams)
        probs = np.empty((len(texts), parts[0][1].shape[1]), dtype=np.float32)
        for idx, p in parts:
            probs[idx] = p
        return probs

    def one(self, text: str) -> np.ndarray:
        enc = self.tok([text], truncation=True, max_length=MAX_LENGTH, return_tensors="np")
        return softmax(self.forward({k: enc[k].astype(np.int64) for k in MODEL_INPUTS}))[0]


class StreamsSide(HFSide):
    """An HFSide whose batches run two at a time, as ours do on a CPU; one text at a time it is `single` (one
    batch, all the threads), as ours is."""

    def __init__(self, tokenizer, forward, batch_size: int, single: HFSide):
        super().__init__(tokenizer, forward, batch_size, streams=2)
        self.single = single

    def one(self, text: str) -> np.ndarray:
        return self.single.one(text)


class OursSide:
    def __init__(self, predictor, labels: list[str], batch_size: int, streams: int | None = None):
        self.predictor, self.labels, self.batch_size, self.streams = predictor, labels, batch_size, streams

    def file(self, texts: list[str]) -> np.ndarray:
        results = self.predictor.predict([{"text": t} for t in texts], batch_size=self.batch_size,
                                         streams=self.streams)
        return np.array([[r["probabilities"][lab] for lab in self.labels] for r in results], dtype=np.float32)

    def one(self, text: str) -> np.ndarray:
        return self.file([text])[0]


def torch_forward(model, device: torch.device):
    @torch.inference_mode()
    def forward(inputs: dict[str, np.ndarray]) -> np.ndarray:
        logits = model(**{k: torch.from_numpy(v).to(device) for k, v in inputs.items()}).logits
        return logits.float().cpu().numpy()
    return forward


def ort_forward(path: Path, threads: int):
    sess = session(path, threads=threads)  # `bertforge predict --backend onnx`'s session, on `threads` threads
    names = [i.name for i in sess.get_inputs()]

    def forward(inputs: dict[str, np.ndarray]) -> np.ndarray:
        return sess.run(["logits"], {k: inputs[k] for k in names})[0]
    return forward


def by_operator(predictor: Predictor) -> Predictor | None:
    """The predictor with its encoders that run a sequence at a time (`FusedEncoder.by_sequence`) run over the batch
    one operator after another instead; None where none runs a sequence at a time."""
    by_sequence = [m for m in predictor.task_model.model.modules() if isinstance(m, FusedEncoder)
                   and m.sequence_weights is not None]
    for encoder in by_sequence:
        encoder.sequence_weights = None
    return predictor if by_sequence else None


def our_sides(args: argparse.Namespace, model_dir: Path, ours: Predictor, on_cpu: bool) -> tuple[dict, list[str]]:
    """(our sides by name, the reasons of those this device or CPU cannot run)."""
    labels = ours.task.labels
    sides = {"ours fp32": OursSide(ours, labels, args.batch_size)}
    left_out = []
    for name, options in OURS_NARROW.items():
        try:
            predictor = Predictor(model_dir, EngineOptions(device=args.device, **options))
            sides[name] = OursSide(predictor, labels, args.batch_size)
        except BertforgeError as e:  # not on this device or CPU: say so and go on
            left_out.append(f"{name} ({e})")
    if args.int8_onednn and "ours int8" in sides and transforms.vnni_products():
        with transforms.on_onednn():
            predictor = Predictor(model_dir, EngineOptions(device=args.device, quantize="int8"))
        sides["ours int8 on oneDNN"] = OursSide(predictor, labels, args.batch_size)
    for name, asked, options in (("int8", args.int8_operators, {"quantize": "int8"}),
                                 ("fp32", args.fp32_by_operator, {})):
        if asked and f"ours {name}" in sides:
            predictor = by_operator(Predictor(model_dir, EngineOptions(device=args.device, **options)))
            if predictor is not None:
                sides[f"ours {name}, by operator"] = OursSide(predictor, labels, args.batch_size)
    if args.fp32_onednn and packed_linear.fp32_panels():
        with transforms.on_onednn():
            predictor = Predictor(model_dir, EngineOptions(device=args.device))
        sides["ours fp32 on oneDNN"] = OursSide(predictor, labels, args.batch_size)
    if args.fp32_operators and transforms.FUSE_FP32:
        transforms.FUSE_FP32 = False
        try:
            predictor = Predictor(model_dir, EngineOptions(device=args.device))
        finally:
            transforms.FUSE_FP32 = True
        sides["ours fp32 on operators"] = OursSide(predictor, labels, args.batch_size)
    if args.one_stream:
        for name in list(sides):
            sides[f"{name}, 1 stream"] = OursSide(sides[name].predictor, labels, args.batch_size, streams=1)
    if args.backend_onnx and on_cpu:
        for name, options in (("ours --backend onnx fp32", {}), ("ours --backend onnx int8", {"quantize": "int8"})):
            predictor = Predictor(model_dir, EngineOptions(backend="onnx", **options))
            sides[name] = OursSide(predictor, labels, args.batch_size)
    return sides, left_out


def ort_sides(ref_tok, fp32: Path, int8: Path, batch_size: int, threads: int) -> dict:
    """The ONNX Runtime sides by name, on the graphs `fp32` and `int8`: one batch at a time on all `threads`, and
    with 2 or more threads also two at a time on half of them each."""
    sides = {"onnxruntime fp32": HFSide(ref_tok, ort_forward(fp32, threads), batch_size),
             "onnxruntime int8": HFSide(ref_tok, ort_forward(int8, threads), batch_size)}
    if threads >= 2:
        for name, path in (("fp32", fp32), ("int8", int8)):
            sides[f"onnxruntime {name}, 2 streams"] = StreamsSide(
                ref_tok, ort_forward(path, threads // 2), batch_size, sides[f"onnxruntime {name}"])
    return sides
