"""`bertforge predict`, `bertforge fill-mask` and `bertforge embed`.

    bertforge predict --model runs/sst2 --text "a gorgeous, witty film"
    bertforge predict --model runs/sst2 --input texts.jsonl --out predictions.jsonl --quantize int8
    bertforge fill-mask --model runs/mini "the quick brown [MASK] jumps over the lazy dog"
    bertforge fill-mask --model runs/mini --input texts.txt --top-k 3 --json --quantize int8
    bertforge embed --model runs/mini --text "a first text" "a second one" --pooling mean
    bertforge embed --model runs/mini --input texts.txt --out vectors.npy --pooling mean --normalize
    bertforge embed --model runs/mini --input texts.txt --out vectors.npy --backend onnx   # ONNX Runtime

--input takes a text file (one text per line) or JSONL ({"text": ...} per line; for predict the task's fields:
{"text", "text_pair"}, QA {"question", "context"}, multiple choice {"context", "choices"}). Inputs are batched by
length, so no time goes into padding; --precision bf16 (CPUs with AVX512-BF16 or AMX)
runs the model in bfloat16 and --quantize int8 (CPU) makes the Linear layers int8: bf16 about twice as fast
as fp32, int8 1.4-2x by CPU, for a small change in the outputs (see bench/inference.py).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from bertforge.bounds import at_least
from bertforge.commands.arguments import Command, check_output_file, command_args, emit_jsonl, options_from
from bertforge.errors import BertforgeError
from bertforge.options import EngineOptions, option, same_as, windows_option


@command_args(EngineOptions)
class PredictArgs:
    """`bertforge predict`'s arguments: these, then the options of EngineOptions."""

    model: str = option(help="fine-tuned model directory (from `bertforge finetune`)")
    text: list[str] = option([], help="text(s) to predict on; for QA the question")
    text_pair: str | None = option(None, help="second text of a pair; for QA the context")
    input: str | None = option(None, help="JSONL file of inputs: {\"text\", \"text_pair\"} per line (QA: "
                                          "{\"question\", \"context\"}; multiple choice: {\"context\", \"choices\"})")
    out: str | None = option(None, help="write JSONL predictions here instead of standard output")
    batch_size: int = option(64, help="sequences per forward pass",
                             bound=at_least(1, "more than 2**20 sequences at once fit no device", at_most=2**20))
    windows: int = windows_option()


def run_predict(args: PredictArgs) -> int:
    from bertforge.commands.inputs import read_input_records
    from bertforge.infer import predict_records

    options = options_from(EngineOptions, args)
    if bool(args.text) == bool(args.input):
        raise BertforgeError("give either --text (one or more) or --input FILE.jsonl")
    check_output_file(args.out)
    records = read_input_records(args.input) if args.input else [
        {"text": t, "text_pair": args.text_pair} for t in args.text]
    results = predict_records(args.model, records, options, batch_size=args.batch_size, windows=args.windows)
    emit_jsonl(results, args.out, "predictions")
    return 0


def _texts(texts: list[str], input_file: str | None) -> list[str]:
    """--text arguments, then the texts of --input FILE."""
    from bertforge.commands.inputs import read_input_records, record_texts

    out = list(texts)
    if input_file:
        out += record_texts(read_input_records(input_file), input_file)
    return out


@dataclass
class FillMaskArgs:
    """`bertforge fill-mask`'s arguments: EngineOptions' but --backend (the masked-LM head runs on bertforge's own
    engine)."""

    model: str = option(help="model directory with an MLM head (from `bertforge pretrain`)")
    text: list[str] = option([], positional=True, help="text(s) with [MASK] where a word should be predicted")
    input: str | None = option(None, help="file with one text per line (or JSONL with a 'text' field)")
    top_k: int = option(5, help="predictions per [MASK]",
                        bound=at_least(1, "more words than any vocabulary has", at_most=2**22))
    json: bool = option(False, help="print JSON lines instead of a table")
    quantize: str | None = same_as(EngineOptions, "quantize")
    precision: str = same_as(EngineOptions, "precision")
    device: str | None = same_as(EngineOptions, "device")


def run_fill_mask(args: FillMaskArgs) -> int:
    from bertforge.infer import MaskFiller

    options = options_from(EngineOptions, args)
    texts = _texts(args.text, args.input)
    if not texts:
        raise BertforgeError("give a text with [MASK], or --input FILE")
    filler = MaskFiller(args.model, options)
    results = filler.fill(texts, top_k=args.top_k)
    for text, masks in zip(texts, results, strict=True):
        if args.json:
            print(json.dumps({"text": text, "masks": masks}, ensure_ascii=False))
            continue
        print(text)
        for n, candidates in enumerate(masks, 1):
            shown = "  ".join(f"{c['token']} {c['score']:.3f}" for c in candidates)
            print(f"  [MASK] {n}: {shown}")
    return 0


@command_args(EngineOptions)
class EmbedArgs:
    """`bertforge embed`'s arguments: these, then the options of EngineOptions."""

    model: str = option(help="model directory (pretrained or fine-tuned)")
    text: list[str] = option([], help="text(s) to embed")
    input: str | None = option(None, help="file with one text per line (or JSONL with a 'text' field)")
    out: str | None = option(None, help="output: .npy (an N x H array) or .jsonl (default: JSONL on stdout)")
    pooling: str = option("cls", help="cls: final [CLS] state; mean: mean of token states; pooler: BERT's pooler",
                          choices=["cls", "mean", "pooler"])
    normalize: bool = option(False, help="scale each vector to unit length")


def run_embed(args: EmbedArgs) -> int:
    import numpy as np

    from bertforge.infer import Encoder

    options = options_from(EngineOptions, args)
    texts = _texts(args.text, args.input)
    if not texts:
        raise BertforgeError("give --text or --input FILE")
    if args.out and not args.out.endswith((".npy", ".jsonl")):
        raise BertforgeError(f"--out {args.out}: name the file .npy (an N x H array) or .jsonl")
    check_output_file(args.out)
    encoder = Encoder(args.model, options)
    vectors = encoder.embed(texts, pooling=args.pooling, normalize=args.normalize)
    if args.out and args.out.endswith(".npy"):
        from bertforge.files import write_bytes

        # np.save into a file writes the array with ndarray.tofile, which can lose a write on a full disk without
        # a word: save into memory, then write the bytes as every other output is written
        buffer = io.BytesIO()
        np.save(buffer, vectors)
        write_bytes(args.out, buffer.getvalue())
        print(f"{vectors.shape[0]} x {vectors.shape[1]} embeddings written to {args.out}")
        return 0
    emit_jsonl(({"text": t, "embedding": [round(float(x), 6) for x in v]} for t, v in zip(texts, vectors, strict=True)),
               args.out, "embeddings")
    return 0


COMMANDS = [
    Command("predict", PredictArgs, run_predict, help="predict with a fine-tuned model on new text",
            description=__doc__, keeps_freed_memory=True),
    Command("fill-mask", FillMaskArgs, run_fill_mask, help="predict the words behind [MASK]", description=__doc__,
            keeps_freed_memory=True),
    Command("embed", EmbedArgs, run_embed, help="sentence embeddings (CLS or mean pooling)", description=__doc__,
            keeps_freed_memory=True),
]
