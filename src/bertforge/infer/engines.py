"""The inference engines: `Encoder` (embeddings), `MaskFiller` (fill-mask) and `Predictor` (a fine-tuned task's
predictions), each a model directory loaded once for many calls. Each takes its device, precision, quantization
and backend as one `bertforge.options.EngineOptions` (which checks them together; what this machine gives for them:
`checks`), its model made fast in `transforms`, its batches grouped and run in `bertforge.batching`."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bertforge.batching import MAX_TOKENS, length_batches, run_batches
from bertforge.config import BertConfig
from bertforge.data.padding import pad_ids
from bertforge.electra import generator_of, masked_lm_class
from bertforge.errors import BertforgeError
from bertforge.infer.checks import auto_streams, engine_device
from bertforge.infer.transforms import prepare
from bertforge.model_files import load_model
from bertforge.options import DEFAULT_WINDOWS, EngineOptions
from bertforge.ort import load_ort_model
from bertforge.tasks.runner import TaskModel, load_encoder, load_task, load_task_model, model_device, run_model
from bertforge.tokenizer import Tokenizer


def _cyclic_gc_paused(method: Callable) -> Callable:
    """`method` with Python's cyclic garbage collector held off while it runs (as it was after). A call over a file
    builds many small objects (examples, features, token lists, results), all freed by reference counting, whose
    allocations set off collections that walk every object in the process, the model's and the libraries' included.
    Int8 predict over Rotten Tomatoes test ran 1.04x faster without them, and steadier (1,821-1,930 texts/s in six
    runs against 1,556-1,859; a throwaway A/B in one process)."""

    @functools.wraps(method)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return method(*args, **kwargs)
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            gc.enable()

    return paused


def _padded_batch(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of `pad_ids`, on `device`."""
    ids, mask = pad_ids(rows, pad_id)
    return ids.to(device), mask.to(device)


class Encoder:
    """A model directory's encoder for embeddings: `Encoder("runs/mini").embed(["a text", ...])`.

    Any model directory works (pretrained or fine-tuned; heads are ignored). `pooling="pooler"` needs the
    pooler weights (BERT pretrained with NSP has them, a masked-LM-only model does not). `options` as for
    `Predictor` (with backend onnx, `path` may also be an encoder's `bertforge export` directory).
    """

    def __init__(self, path: str | Path, options: EngineOptions | None = None, *, max_length: int = 512):
        options = options or EngineOptions()
        where = None if options.backend == "onnx" else engine_device(options)
        self.tokenizer = Tokenizer.from_pretrained(path)
        config = BertConfig.from_json(path)
        self.tokenizer.check_compatible(config)
        self.max_length = min(max_length, config.max_position_embeddings)
        self.hidden_size = config.hidden_size
        self.backend = options.backend
        if where is None:
            self.model = load_ort_model(Path(path), options.quantize, encoder=True)
            return
        self.model = prepare(load_encoder(path), options, where)

    @classmethod
    def sharing(cls, model: nn.Module, tokenizer: Tokenizer, *, max_length: int = 512) -> Encoder:
        """An Encoder on a BertModel another engine has loaded and prepared, such as a fine-tuned model's
        (`Predictor(path).task_model.model.bert`): embeddings without a second copy of the weights (`bertforge
        serve` does this). The model keeps its pooler, or its lack of one, as the directory's own encoder would."""
        encoder = cls.__new__(cls)
        encoder.model, encoder.tokenizer, encoder.backend = model, tokenizer, "torch"
        encoder.max_length = min(max_length, model.config.max_position_embeddings)
        encoder.hidden_size = model.config.hidden_size
        return encoder

    @torch.no_grad()
    @_cyclic_gc_paused
    def embed(self, texts: Sequence[str], *, pooling: str = "cls", normalize: bool = False,
              max_tokens: int = MAX_TOKENS) -> np.ndarray:
        """(N, H) float32, row i for texts[i]: the final [CLS] state (`cls`), the mean of the real tokens'
        final states, [CLS] and [SEP] included (`mean`), or the pooler's output (`pooler`). Texts longer
        than max_length tokens are truncated. `normalize` scales each row to unit length."""
        if pooling not in ("cls", "mean", "pooler"):
            raise BertforgeError(f"pooling {pooling!r} is not one of cls, mean, pooler")
        if pooling == "pooler" and self.model.pooler is None:
            raise BertforgeError("this model has no pooler weights: use --pooling cls or mean")
        if isinstance(texts, str):
            raise TypeError("embed() takes a list of texts; wrap a single text in a list")
        rows = self.tokenizer.encode_batch(list(texts), max_length=self.max_length, padding=False).ids
        out = np.zeros((len(rows), self.hidden_size), dtype=np.float32)
        device = model_device(self.model)
        batches = list(length_batches([len(r) for r in rows], max_tokens=max_tokens))

        def run(idx: np.ndarray) -> None:
            ids, mask = _padded_batch([rows[i] for i in idx], self.tokenizer.pad_id, device)
            res = self.model(ids, attention_mask=mask, cls_only=pooling != "mean")
            if pooling == "cls":
                vec = res.sequence_output[:, 0]
            elif pooling == "pooler":
                vec = res.pooled_output
            else:
                m = mask.unsqueeze(-1).float()  # (B, T, 1)
                vec = (res.sequence_output.float() * m).sum(1) / m.sum(1)  # summed in fp32 under bf16 too
            out[idx] = vec.float().cpu().numpy()

        run_batches(run, batches, auto_streams(self.backend, device, len(batches)))
        if normalize:
            out /= np.linalg.norm(out, axis=1, keepdims=True).clip(min=1e-12)
        return out


class MaskFiller:
    """`MaskFiller("runs/mini").fill("the [MASK] of the union", top_k=5)`: the likeliest tokens per [MASK].

    The MLM head runs on the [MASK] positions only (not on every token), so its vocabulary-sized output
    costs nothing for the rest of the text. `options` as for `Predictor`, on bertforge's own engine only (ONNX
    Runtime runs encoders and task heads, not the masked-LM head). An ELECTRA run directory's model (the
    discriminator) has no masked-LM head: its generator (`generator/`) fills the masks.
    """

    def __init__(self, path: str | Path, options: EngineOptions | None = None):
        options = options or EngineOptions()
        if options.backend != "torch":
            raise BertforgeError(f"fill-mask runs on bertforge's own engine, not backend {options.backend}: use "
                                 "backend torch (ONNX Runtime runs encoders and task heads)")
        where = engine_device(options)
        path = generator_of(path)
        model, fresh = load_model(masked_lm_class(BertConfig.from_json(path)), path, verbose=False)
        if any(k.startswith("cls.predictions.") for k in fresh):
            raise BertforgeError(f"{path} has no masked-LM head (cls.predictions.*): fill-mask needs a model from "
                                 "`bertforge pretrain` (or a Hugging Face BertForMaskedLM/BertForPreTraining)")
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.tokenizer.check_compatible(model.config)
        self.max_length = model.config.max_position_embeddings
        self.model = prepare(model.eval(), options, where)

    @torch.no_grad()
    @_cyclic_gc_paused
    def fill(self, texts: str | Sequence[str], *, top_k: int = 5,
             max_tokens: int = MAX_TOKENS) -> list[list[dict]] | list[list[list[dict]]]:
        """Per text, per [MASK] in it (left to right), the top_k {"token", "score"}, most probable first
        (score = the softmax probability over the whole vocabulary). A single string gives that text's list."""
        if top_k < 1:
            raise BertforgeError(f"--top-k {top_k} must be at least 1")
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        tok = self.tokenizer
        rows = tok.encode_batch(texts, max_length=self.max_length, padding=False).ids
        for t, r in zip(texts, rows, strict=True):
            if tok.mask_id not in r:
                where = "" if "[MASK]" not in t else f" within its first {self.max_length} tokens"
                raise BertforgeError(f"no [MASK] token in {_short(t)!r}{where}: write [MASK] where a word should be "
                                     "predicted")
        results: list[Any] = [[] for _ in texts]
        device = model_device(self.model)
        for idx in length_batches([len(r) for r in rows], max_tokens=max_tokens):
            ids, mask = _padded_batch([rows[i] for i in idx], tok.pad_id, device)
            labels = torch.where(ids == tok.mask_id, ids, torch.full_like(ids, -100))  # selects [MASK]s
            logits = self.model(ids, attention_mask=mask, labels=labels).logits  # (M, V), row-major
            scores, top = logits.float().softmax(-1).topk(min(top_k, logits.shape[-1]), dim=-1)  # (M, k)
            batch_rows = (labels != -100).nonzero()[:, 0].tolist()  # row-major: masks left to right
            for row, ps, ts in zip(batch_rows, scores.tolist(), top.tolist(), strict=True):
                results[int(idx[row])].append([{"token": tok.id_to_token(t), "score": p}
                                               for t, p in zip(ts, ps, strict=True)])
        return results[0] if single else results


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _example(task, record: dict, n: int):
    def need(*keys):
        for key in keys:
            if record.get(key) in (None, ""):
                raise BertforgeError(f"input {n}: {task.name} needs {' and '.join(repr(k) for k in keys)} "
                                     f"(got keys {sorted(record)})")

    if task.kind == "question_answering":
        question = record.get("question", record.get("text"))
        context = record.get("context", record.get("text_pair"))
        if not question or not context:
            raise BertforgeError(f"input {n}: question answering needs a question (--text) and a context "
                                 f"(--text-pair)")
        return task.example(question, context)
    if task.kind == "multiple_choice":
        need("context", "choices")
        return task.example(record["context"], list(record["choices"]))
    need("text")
    if task.kind == "token_classification":
        return task.example(record["text"])
    return task.example(record["text"], record.get("text_pair"))


class Predictor:
    """A fine-tuned model directory (from `bertforge finetune`), loaded once for many predictions:
    `Predictor("runs/sst2").predict([{"text": "a gorgeous, witty film"}])`. The task (and so the output) is
    read from the directory's task.json; see `predict`.

    `options` (an `EngineOptions`; the default fp32 on bertforge's own engine), the same for `Encoder` and
    `MaskFiller`: precision fp32, bf16 (about twice as fast on CPUs with AVX512-BF16 or AMX) or auto (bf16 where
    the hardware has it); quantize int8 (CPU) makes the Linear layers int8 and keeps the rest fp32 (attention over
    short texts bf16 on CPUs with AVX512-BF16 or AMX); bench/inference.py measures each against ONNX Runtime, with
    its accuracy. Backend onnx runs the model on ONNX Runtime instead (CPU, fp32 or int8; `path` an exported
    directory or a fine-tuned one, exported on the way: `bertforge.ort`):
    `Predictor("runs/sst2", EngineOptions(quantize="int8"))`."""

    def __init__(self, path: str | Path, options: EngineOptions | None = None):
        options = options or EngineOptions()
        self.backend = options.backend
        if options.backend == "onnx":
            self.task_model = _load_ort_task_model(Path(path), options.quantize)
        else:
            where = engine_device(options)
            self.task_model = load_task_model(path, device=str(where))
            self.task_model.model = prepare(self.task_model.model, options, where)
        self.task = self.task_model.task

    @torch.no_grad()
    @_cyclic_gc_paused
    def predict(self, records: Sequence[dict], *, batch_size: int = 64, streams: int | None = None,
                windows: int = DEFAULT_WINDOWS) -> list[dict]:
        """One result per record, in order. `streams`: batches run at once, each on its share of the threads
        (default: 2 on a CPU with 2 or more threads and 4 or more batches, else 1; `bertforge.batching`).
        `windows`: a single text longer than the model's sequence length (classification, regression) is read in up
        to this many windows of it, from its start to its end, their logits averaged (1: its first tokens only).
        Records and results by the task's kind:

        classification   {"text", "text_pair"?} -> {"label", "score", "probabilities": {label: p}}
        regression       {"text", "text_pair"?} -> {"score"}
        token tagging    {"text"} -> {"entities": [{"type", "start", "end", "text"}], "tags": [[word, tag]]}
                         (start/end: character offsets into the text)
        question answer  {"question", "context"} -> {"answer", "start", "end", "score"} (offsets in context)
        multiple choice  {"context", "choices"} -> {"choice", "probabilities"}
        """
        tm, task = self.task_model, self.task
        if not records:
            return []
        examples = [_example(task, r, n) for n, r in enumerate(records, 1)]
        for n, ex in enumerate(examples):
            ex.id = str(n)
        label_map = task.label_map() if task.labels and task.kind in ("classification", "token_classification") \
            else None
        features = task.features(examples, tm.tokenizer, tm.max_length, label_map, windows=windows)
        device = model_device(tm.model)
        if streams is None:
            streams = auto_streams(self.backend, device, -(-len(features) // batch_size))
        elif streams < 1:
            raise BertforgeError(f"streams must be at least 1, not {streams}")
        outputs = run_model(tm.model, features, tm.tokenizer.pad_id, batch_size=batch_size, device=device,
                            streams=streams)
        return _results(task, examples, features, outputs)


def _softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in numpy: torch's runs on every thread (its grain is 0), and on a loaded CPU (a
    server's, whose event loop and clients share the cores) waking its worker threads for a few logits took 4-8 ms
    a call on a 2-core EPYC, against microseconds here."""
    logits = np.asarray(logits, dtype=np.float32)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _results(task, examples: list, features: list, outputs: Any) -> list[dict]:
    if task.kind in ("classification", "regression"):
        outputs = task.per_example(features, outputs, len(examples))
    if task.kind == "classification":
        # converted to Python numbers in two calls, not element by element: numpy's scalar calls took 9 ms of a
        # BERT-tiny's ~150 ms over 1,323 snippets
        probs = _softmax(outputs)
        labels = task.labels
        return [{"label": labels[b], "score": row[b], "probabilities": dict(zip(labels, row, strict=True))}
                for b, row in zip(probs.argmax(-1).tolist(), probs.tolist(), strict=True)]
    if task.kind == "regression":
        return [{"score": float(v)} for v in np.asarray(outputs).reshape(-1)]
    if task.kind == "multiple_choice":
        probs = _softmax(np.asarray(outputs).reshape(len(examples), -1))
        return [{"choice": b, "probabilities": row} for b, row in zip(probs.argmax(-1).tolist(), probs.tolist(),
                                                                      strict=True)]
    if task.kind == "token_classification":
        tags = task.decode(examples, features, outputs)
        return [{"entities": task.entities(ex, t), "tags": [list(wt) for wt in zip(ex.words, t, strict=True)]}
                for ex, t in zip(examples, tags, strict=True)]
    best = task.nbest(examples, features, outputs)
    return [{"answer": b[0]["text"], "start": b[0]["start"], "end": b[0]["end"], "score": b[0]["probability"]}
            if b else {"answer": "", "start": None, "end": None, "score": 0.0} for b in best]


def predict_records(path: str | Path, records: Sequence[dict], options: EngineOptions | None = None, *,
                    batch_size: int = 64, windows: int = DEFAULT_WINDOWS) -> list[dict]:
    """Predictions of a fine-tuned model directory for input records: `Predictor(path, options).predict(records)`."""
    return Predictor(path, options).predict(records, batch_size=batch_size, windows=windows)


def _load_ort_task_model(path: Path, quantize: str | None) -> TaskModel:
    """A fine-tuned directory, or its ONNX export, as a TaskModel whose model is an ONNX Runtime session."""
    task, spec = load_task(path)
    tokenizer = Tokenizer.from_pretrained(path)
    tokenizer.check_compatible(BertConfig.from_json(path))
    model = load_ort_model(path, quantize)
    return TaskModel(task, model, tokenizer, int(spec.get("max_length", task.max_length)), spec)
