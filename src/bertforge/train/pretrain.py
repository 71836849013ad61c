"""Pretraining: MLM + NSP on prepared data, through the one training loop."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bertforge.checkpoint import WEIGHTS_NAME, unwrap
from bertforge.config import PRESETS, BertConfig
from bertforge.data.loader import PretrainingData
from bertforge.data.shards import read_manifest
from bertforge.device import to_device
from bertforge.errors import BertforgeError
from bertforge.heads import IGNORE_INDEX, BertForPreTraining
from bertforge.options import MIN_SEQ_LEN, DataOptions
from bertforge.tokenizer import Tokenizer
from bertforge.train import distributed
from bertforge.train.budget import (
    REPLANS,
    BudgetPlan,
    Deadline,
    agree,
    load_plan,
    plan_steps,
    save_plan,
    time_call,
    time_steps,
)
from bertforge.train.loop import (
    LoopConfig,
    Trainer,
    TrainResult,
    autocast,
    checkpoints,
    resolve_precision,
    write_run_config,
)
from bertforge.train.recipe import Recipe
from bertforge.train.report import plot_metrics
from bertforge.train.rundir import check_resume, claim_run_dir, used_dir_refusal
from bertforge.train.stacking import HALF_DEPTH_DIR, check_stackable, half_depth, stack_layers

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")


class PretrainingObjective:
    """loss = mean MLM cross-entropy over masked positions + mean NSP cross-entropy over sequences (MLM alone
    with `nsp=False`) + `bow_weight` x the bag-of-words loss on [CLS] (`heads.bag_of_words`), which needs
    `is_special`, the vocabulary-sized mask of tokens to leave out of the bag (`PretrainingData.is_special`)."""

    def __init__(self, nsp: bool = True, bow_weight: float = 0.0, is_special: np.ndarray | None = None):
        self.nsp, self.bow_weight = nsp, bow_weight
        if bow_weight and is_special is None:
            raise ValueError("the bag-of-words loss needs is_special, the mask of the tokenizer's special tokens")
        self.is_special = None if is_special is None else torch.as_tensor(is_special, dtype=torch.bool)

    def counts(self, batch: dict) -> dict[str, float]:
        counts = {"mlm": int((batch["mlm_labels"] != IGNORE_INDEX).sum())}
        if self.nsp:
            counts["nsp"] = int(batch["nsp_labels"].numel())
        if self.bow_weight:
            counts["bow"] = int(batch["input_ids"].shape[0])
        return counts

    def bow_labels(self, batch: dict) -> torch.Tensor:
        """The sequence's original tokens (the masked positions' labels put back), -100 at special tokens and
        padding."""
        labels = batch["mlm_labels"]
        original = torch.where(labels != IGNORE_INDEX, labels, batch["input_ids"])
        if self.is_special.device != original.device:  # moved once, not on every step
            self.is_special = self.is_special.to(original.device)
        special = self.is_special[original]
        return original.masked_fill(special | (batch["attention_mask"] == 0), IGNORE_INDEX)

    def losses(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        out = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                    mlm_labels=batch["mlm_labels"], nsp_labels=batch["nsp_labels"] if self.nsp else None,
                    bow_labels=self.bow_labels(batch) if self.bow_weight else None)
        losses = {"mlm": out.mlm_loss}
        if self.nsp:
            losses["nsp"] = out.nsp_loss
        if self.bow_weight:
            losses["bow"] = self.bow_weight * out.bow_loss  # logged weighted: the terms add up to the loss
        return losses


def evaluate_pretraining(model: BertForPreTraining, batches: list[dict], device: torch.device, *,
                         nsp: bool = True, dist: distributed.Dist | None = None) -> dict[str, float]:
    """MLM accuracy and perplexity over masked positions, NSP accuracy (unless `nsp` is False: a split of one
    document has IsNext pairs only), on fixed validation batches. Under several processes (`dist`) each rank
    passes its share of the batches and gets the figures of all of them."""
    mlm_loss_sum = mlm_correct = mlm_n = nsp_correct = nsp_n = 0.0
    for batch in batches:
        b = to_device(batch, device)  # as the training step moves its batches
        out = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], mlm_labels=b["mlm_labels"],
                    nsp_labels=b["nsp_labels"])
        targets = b["mlm_labels"][b["mlm_labels"] != IGNORE_INDEX]
        mlm_loss_sum += float(torch.nn.functional.cross_entropy(out.mlm_logits.float(), targets, reduction="sum"))
        mlm_correct += float((out.mlm_logits.argmax(-1) == targets).sum())
        mlm_n += targets.numel()
        nsp_correct += float((out.nsp_logits.argmax(-1) == b["nsp_labels"]).sum())
        nsp_n += b["nsp_labels"].numel()
    if dist is not None:
        mlm_loss_sum, mlm_correct, mlm_n, nsp_correct, nsp_n = distributed.all_reduce_sum(
            [mlm_loss_sum, mlm_correct, mlm_n, nsp_correct, nsp_n], dist)
    mean = mlm_loss_sum / max(mlm_n, 1)
    results = {"mlm_accuracy": mlm_correct / max(mlm_n, 1), "mlm_loss": mean,
               "mlm_perplexity": math.exp(min(mean, 50.0))}
    if nsp:
        results["nsp_accuracy"] = nsp_correct / max(nsp_n, 1)
    return results


def resolve_model_config(spec: str, vocab_size: int, max_seq_len: int) -> BertConfig:
    """A preset name, a config.json, or a model directory; the vocabulary size comes from the tokenizer."""
    if spec in PRESETS:
        config = BertConfig.from_preset(spec, vocab_size=vocab_size)
    else:
        path = Path(spec)
        if not path.exists():
            raise BertforgeError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                                 f"or model directory")
        config = BertConfig.from_json(path)
        if config.vocab_size != vocab_size:
            raise BertforgeError(f"{spec} has vocab_size {config.vocab_size} but the data's tokenizer has "
                                 f"{vocab_size}: set vocab_size to {vocab_size} or prepare the data with the "
                                 f"model's tokenizer")
    if max_seq_len > config.max_position_embeddings:
        raise BertforgeError(f"the data's sequence length {max_seq_len} exceeds the model's "
                             f"max_position_embeddings {config.max_position_embeddings}: prepare shorter "
                             f"sequences or raise max_position_embeddings")
    return config


def _check_resume(out_dir: Path, run_config: dict, minutes: float | None, *, verbose: bool) -> list[dict]:
    """The resumed run's history of changed options (for run_config.json), after `check_resume` refused what may
    not change. Nothing is compared when no checkpoint was written: the run starts again from step 0."""
    found = checkpoints(out_dir)
    recorded_file = out_dir / "run_config.json"
    if not found or not recorded_file.is_file():
        return []
    plain = json.loads(json.dumps(run_config, default=lambda x: asdict(x) if dataclasses.is_dataclass(x) else str(x)))
    if minutes is not None and plain.get("budget"):
        plain["budget"]["minutes"] = minutes  # the plan is reloaded on resume: compare the budget asked for now
    changed = check_resume(out_dir, plain)
    steps = plain["loop"]["steps"]
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):  # the trainer reports a bad checkpoint
        steps = int(json.loads((found[-1][1] / "state.json").read_text())["total_steps"])  # a budget re-planned
    if found[-1][0] >= steps:
        raise BertforgeError(f"the run in {out_dir} is complete (checkpoint at step {found[-1][0]} of {steps}) and "
                             f"its learning-rate schedule has ended: to train further, start a new run from its "
                             f"model with --init {out_dir} and a new --out")
    try:
        history = json.loads(recorded_file.read_text(encoding="utf-8")).get("resumes") or []
    except ValueError:
        history = []
    if changed:
        history.append({"step": found[-1][0], "changed": changed})
    if changed and verbose:
        print("--resume: " + ", ".join(f"{c['option']} {c['recorded']} -> {c['now']}" for c in changed), flush=True)
    return history


def pretrain(data_dir: str | Path, out_dir: str | Path, *, model: str = "mini", loop: LoopConfig,
             data_options: DataOptions | None = None, init: str | Path | None = None, resume: bool = False,
             max_seq_len: int | None = None, dropout: float | None = None, pre_layer_norm: bool = False,
             minutes: float | None = None, warmup_fraction: float | None = None,
             recipe: Recipe | None = None, stack_fraction: float = 0.0,
             stack_length_fraction: float = 1.0, bow_weight: float = 0.0) -> TrainResult:
    """Pretrain a BERT with MLM (+ NSP unless `data_options.nsp` is False) on `data_dir` (made by `bertforge
    prepare`) into `out_dir`.

    `init` starts from a model directory's weights (the paper's second phase at length 512 starts from the
    first phase's model); the optimizer and schedule start fresh. `resume` continues exactly from the last
    checkpoint in `out_dir`. `dropout` overrides the model's dropout while pretraining (the saved config keeps
    its own); `pre_layer_norm` builds a new model with pre-LN layers. `minutes` replaces `loop.steps` by the
    steps that end at that wall time (see budget.py), with `warmup_fraction` of them as warmup (None: keep
    `loop.warmup_steps`); `recipe` is recorded in run_config.json. `bow_weight` > 0 adds that weight of a
    bag-of-words loss on [CLS] (`PretrainingObjective`): without NSP nothing else trains [CLS] to read the
    sequence.

    `stack_fraction` F > 0 (a new model only) stacks (stacking.py): a model of half the depth is pretrained for
    the first F of the steps or minutes in `out_dir/half-depth/`, then its layers are copied on top of
    themselves and the full-depth model is pretrained for the rest in `out_dir`, with a warmup and decay of its
    own. Both stages read the data from its start, as the measured runs did. `stack_length_fraction` < 1 trains
    the first stage on sequences that much shorter (at least 8 tokens), with as many more of them a batch (the
    same tokens a step): the half-depth model leaves the masked-LM's early plateau after fewer tokens at length 16
    or 32 than at 64.
    """
    out_dir = Path(out_dir)
    common = dict(data_dir=data_dir, loop=loop, data_options=data_options or DataOptions(), resume=resume,
                  max_seq_len=max_seq_len, dropout=dropout, pre_layer_norm=pre_layer_norm, minutes=minutes,
                  warmup_fraction=warmup_fraction, recipe=recipe, bow_weight=bow_weight)
    try:
        if not stack_fraction or init is not None:
            if resume and (out_dir / HALF_DEPTH_DIR).is_dir():
                raise BertforgeError(f"the run in {out_dir} was stacked (it has {HALF_DEPTH_DIR}/): resume it with "
                                     f"the --stack-fraction it was started with (run_config.json)")
            return _pretrain_stage(out_dir, model=model, init=init, **common)
        return _pretrain_stacked(out_dir, model, stack_fraction, stack_length_fraction, common)
    finally:
        distributed.teardown()


def _model_depth(spec: str) -> int | None:
    """The number of layers `--model` asks for, when it can be read without the data (else None: the stage
    that builds the model reports the problem)."""
    if spec in PRESETS:
        return PRESETS[spec][0]
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    return BertConfig.from_json(path).num_hidden_layers if path.is_file() else None


def _stack_changes(out_dir: Path, stack: dict) -> BertforgeError | None:
    """A resumed stacked run asked for a different split, budget or length than it was started with (said in
    the whole run's terms, before a stage compares its own share), or was not stacked at all."""
    for path in (out_dir / "run_config.json", out_dir / HALF_DEPTH_DIR / "run_config.json"):
        try:
            recorded = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # not started, or unreadable: the stage's own check says so
        before = recorded.get("stack") if isinstance(recorded, dict) else None
        if not isinstance(before, dict):
            return BertforgeError(f"the run in {out_dir} was not stacked: resume it with --stack-fraction 0")
        names = {"fraction": "--stack-fraction", "minutes": "the time budget (--minutes):", "steps": "--steps",
                 "length_fraction": "--stack-length-fraction"}
        before = {"length_fraction": 1.0, **before}  # runs before the option trained both stages at one length
        changed = [f"{flag} {json.dumps(before.get(key))} -> {json.dumps(stack[key])}"
                   for key, flag in names.items() if before.get(key) != stack[key]]
        if changed:
            return BertforgeError(f"--resume cannot change what the run in {out_dir} was started with: "
                                  f"{'; '.join(changed)}. Resume with the recorded values (run_config.json), or "
                                  f"start a new run in a new --out")
    return None


def _split(loop: LoopConfig, minutes: float | None, fraction: float) -> list[tuple[LoopConfig, float | None]]:
    """The two stages' loop settings and budgets: `fraction` of the steps (or minutes) for the first."""
    first = min(max(1, round(fraction * loop.steps)), loop.steps - 1) if loop.steps > 1 else 1
    stages = []
    for steps, share in ((first, fraction), (max(1, loop.steps - first), 1 - fraction)):
        warmup = min(round(loop.warmup_steps * steps / loop.steps), steps - 1)
        stages.append((dataclasses.replace(loop, steps=steps, warmup_steps=max(0, warmup)),
                       minutes * share if minutes is not None else None))
    return stages


def _short_stage(loop: LoopConfig, run_len: int, short_len: int) -> LoopConfig:
    """The first stage's loop at `short_len` (<= `run_len`): as many more sequences a batch and micro-batch, so a
    step takes about as many tokens as at the run's length (the same loop when the lengths are equal)."""
    def scale(n: int | None) -> int | None:
        return None if n is None else max(1, round(n * run_len / short_len))

    return dataclasses.replace(loop, batch_size=scale(loop.batch_size), micro_batch_size=scale(loop.micro_batch_size))


def _run_length(data_dir: str | Path, max_seq_len: int | None) -> int:
    return int(max_seq_len or read_manifest(Path(data_dir))["max_seq_len"])


def _pretrain_stacked(out_dir: Path, model: str, fraction: float, length_fraction: float,
                      common: dict) -> TrainResult:
    started = time.perf_counter()
    loop, resume = common["loop"], common["resume"]
    check_stackable(_model_depth(model))  # before either stage claims a directory
    run_len = _run_length(common["data_dir"], common["max_seq_len"])
    short_len = min(run_len, max(int(MIN_SEQ_LEN.lo), round(length_fraction * run_len)))
    d = distributed.setup(loop.device)
    refusal = None
    if d.is_main and not resume:  # the stages claim their own directories; a used --out is refused before both
        refusal = used_dir_refusal(out_dir)
    stack = {"fraction": fraction, "minutes": common["minutes"], "steps": None if common["minutes"] else loop.steps,
             "length_fraction": length_fraction}
    if d.is_main and resume:
        refusal = _stack_changes(out_dir, stack)
    if distributed.any_rank(refusal is not None, d):
        raise refusal or BertforgeError(f"--out {out_dir} was refused (see the main process's error)")
    (first_loop, first_minutes), (second_loop, second_minutes) = _split(loop, common["minutes"], fraction)
    first_dir = out_dir / HALF_DEPTH_DIR
    if (first_dir / WEIGHTS_NAME).is_file():
        if d.is_main:
            print(f"reusing the half-depth stage in {first_dir}", flush=True)
    else:
        _pretrain_stage(first_dir, model=model, init=None, half=True, stage="half depth: ",
                        stack={**stack, "stage": "half depth"},
                        **{**common, "loop": _short_stage(first_loop, run_len, short_len), "minutes": first_minutes,
                           "max_seq_len": short_len, "resume": resume and first_dir.is_dir()})
    result = _pretrain_stage(out_dir, model=model, init=first_dir, stack_init=True, stage="full depth: ",
                             stack={**stack, "stage": "full depth"}, allow=(HALF_DEPTH_DIR,),
                             **{**common, "loop": second_loop, "minutes": second_minutes})
    if d.is_main:
        took = (time.perf_counter() - started) / 60
        budget = f" of a {common['minutes']:g}-minute budget" if common["minutes"] is not None else ""
        print(f"stacked pretraining took {took:.1f} min{budget} (this process): half depth in {first_dir}, "
              f"then {result.step:,} steps at full depth", flush=True)
    return result


def _pretrain_stage(out_dir: str | Path, *, data_dir: str | Path, model: str, loop: LoopConfig,
                    data_options: DataOptions, init: str | Path | None, resume: bool, max_seq_len: int | None,
                    dropout: float | None, pre_layer_norm: bool, minutes: float | None,
                    warmup_fraction: float | None, recipe: Recipe | None, bow_weight: float = 0.0,
                    half: bool = False,
                    stack_init: bool = False, stack: dict | None = None, stage: str = "",
                    allow: tuple[str, ...] = ()) -> TrainResult:
    """One pretraining run into `out_dir` (see `pretrain`). `half` halves the new model's depth and
    `stack_init` doubles the `init` model's (the two stages of stacking, `stack` recorded in run_config.json);
    `allow` names entries of `out_dir` that do not make it a used directory (the first stage's, for the
    second)."""
    started = time.perf_counter()
    opts = data_options
    d = distributed.setup(loop.device)
    out_dir = Path(out_dir)
    run_dir = None
    try:
        resolve_precision(loop.precision, d.device)  # a refused precision before the directory is claimed
        # One run, one process per directory: the main process claims it, and every rank stops if it cannot.
        refusal = None
        if d.is_main:
            try:
                run_dir = claim_run_dir(out_dir, resume=resume, allow=allow)
            except BertforgeError as e:
                refusal = e
        if distributed.any_rank(refusal is not None, d):
            raise refusal or BertforgeError(f"--out {out_dir} was refused (see the main process's error)")

        def load(split: str, rank: int, world: int) -> PretrainingData:
            return PretrainingData(data_dir, split, max_seq_len=max_seq_len, short_seq_prob=opts.short_seq_prob,
                                   masked_lm_prob=opts.masked_lm_prob,
                                   max_predictions_per_seq=opts.max_predictions_per_seq,
                                   whole_word_mask=opts.whole_word_mask, dupe_factor=opts.dupe_factor,
                                   seed=opts.seed, rank=rank, world_size=world, nsp=opts.nsp)

        train_data = load("train", d.rank, d.world_size)
        tokenizer = train_data.tokenizer
        config = resolve_model_config(model, tokenizer.vocab_size, train_data.max_seq_len)
        if init is not None:
            net = BertForPreTraining.from_pretrained(init, verbose=d.is_main)
            if net.config.vocab_size != tokenizer.vocab_size:
                raise BertforgeError(f"--init {init} has vocab_size {net.config.vocab_size} but the data's "
                                     f"tokenizer has {tokenizer.vocab_size}: prepare the data with its tokenizer")
            if (Path(init) / "vocab.txt").is_file():  # a bare config + weights directory has no tokenizer to check
                init_fp = Tokenizer.from_pretrained(init).fingerprint
                if init_fp != tokenizer.fingerprint:
                    raise BertforgeError(f"--init {init} was trained with tokenizer {init_fp}, but --data {data_dir} "
                                         f"was prepared with tokenizer {tokenizer.fingerprint}: prepare the corpus "
                                         f"with the model's tokenizer (`bertforge prepare --tokenizer {init}`)")
            if stack_init:
                net = stack_layers(net)
            config = net.config
        else:
            if pre_layer_norm:
                config = config.replace(pre_layer_norm=True)
            if half:
                config = half_depth(config)
            torch.manual_seed(loop.seed)
            net = BertForPreTraining(config)
        tokenizer.check_compatible(config)
        if dropout is not None:
            net.set_dropout(dropout)
        objective = PretrainingObjective(nsp=opts.nsp, bow_weight=bow_weight, is_special=train_data.is_special)

        micro, accum = loop.accumulation(d.world_size)
        evaluate = None
        if opts.eval_batches > 0:
            val_docs = int(train_data.manifest.get("splits", {}).get("val", {}).get("documents", 0))
            if val_docs:
                # every rank evaluates its share of each global batch: the ranks' batches k together are the
                # one-process batch k, so the figures do not depend on the number of processes
                it = load("val", d.rank, d.world_size).batches(micro)
                val_batches = [next(it) for _ in range(opts.eval_batches)]
                if val_docs == 1 and opts.nsp and d.is_main:
                    print("the val split has a single document, so no NotNext pairs: NSP accuracy is not reported "
                          "(prepare with a larger --val-fraction to have it)")
                evaluate = lambda m: evaluate_pretraining(m, val_batches, d.device,  # noqa: E731
                                                          nsp=opts.nsp and val_docs > 1, dist=d)

        plan = None
        if minutes is not None:
            plan = load_plan(out_dir) if resume else None
            if plan is None:
                seconds = agree(time_steps(net, train_data.batches(micro), lambda m, b: sum(
                    objective.losses(m, b).values()), accum=accum, lr=loop.lr, device=d.device,
                    precision=loop.precision), d)
                eval_seconds = 0.0
                if evaluate is not None:
                    probe = copy.deepcopy(net).to(d.device).eval()
                    with torch.no_grad(), autocast(d.device, resolve_precision(loop.precision, d.device)):
                        eval_seconds = time_call(lambda: evaluate(probe))
                    del probe
                eval_seconds = agree(eval_seconds, d)
                spent = agree(time.perf_counter() - started, d)
                steps = plan_steps(minutes, seconds, eval_seconds, loop.eval_every, spent)
                plan = BudgetPlan(minutes=minutes, seconds_per_step=seconds, eval_seconds=eval_seconds,
                                  steps=steps, spent_before_training=spent)
            warmup = loop.warmup_steps if warmup_fraction is None else round(warmup_fraction * plan.steps)
            loop = dataclasses.replace(loop, steps=plan.steps, warmup_steps=min(warmup, plan.steps - 1))
            if d.is_main:
                print(plan.describe(), flush=True)

        tok_dir = Path(data_dir) / "tokenizer"

        def save_model(m: nn.Module, path: Path) -> None:
            unwrap(m).save_pretrained(path)
            for name in TOKENIZER_FILES:
                if (tok_dir / name).is_file():
                    shutil.copyfile(tok_dir / name, path / name)

        run_config = dict(command="pretrain", data=str(data_dir), model=config.to_dict(), loop=loop,
                          data_options=opts, max_seq_len=train_data.max_seq_len,
                          init=str(init) if init else None, world_size=d.world_size,
                          recipe=recipe.to_dict() if recipe else None, dropout=dropout, bow_weight=bow_weight,
                          stack=stack,
                          budget=asdict(plan) if plan else None,
                          manifest={k: v for k, v in train_data.manifest.items() if not isinstance(v, list)})
        resumes = _check_resume(out_dir, run_config, minutes, verbose=d.is_main) if resume else []
        if d.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            if plan is not None:
                save_plan(out_dir, plan)
            write_run_config(out_dir, **run_config, resumes=resumes)

        class _Data:
            def batches(self, micro_batch_size: int, position: dict | None = None):
                return train_data.batches(micro_batch_size, position=position or 0, num_workers=opts.num_workers)

        deadline = None
        if plan is not None:
            deadline = Deadline(plan.minutes, origin=started, reserve=plan.eval_seconds,
                                every=max(1, plan.steps // REPLANS))
        trainer = Trainer(net, _Data(), objective, loop, out_dir, evaluate=evaluate,
                          save_model=save_model, dist=d, resume=resume, deadline=deadline)
        result = trainer.run()
        if d.is_main:
            plot_metrics(out_dir / "metrics.jsonl", out_dir / "training_curves.png",
                         earlier=Path(init) / "metrics.jsonl" if stack_init else None)
            if plan is not None:
                took = (time.perf_counter() - started) / 60
                print(f"{stage}pretraining took {took:.1f} min of a {plan.minutes:g}-minute budget: {result.step:,} "
                      f"steps (planned {plan.steps:,} at the start)", flush=True)
        distributed.barrier(d)  # the other ranks wait for rank 0's writes: gloo aborts a peer that leaves early
        return result
    finally:
        if run_dir is not None:
            run_dir.release()
