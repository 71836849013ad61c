"""Pretraining: MLM + NSP on prepared data, through the one training loop."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bertforge.config import PRESETS, BertConfig
from bertforge.data.loader import PretrainingData
from bertforge.electra import GENERATOR_DIR, HEAD_FILE, ElectraForPreTraining
from bertforge.errors import BertforgeError
from bertforge.model_files import WEIGHTS_NAME, unwrap
from bertforge.models import BertForPreTraining
from bertforge.options import EMBEDDING_INITS, DataOptions, ElectraOptions, given_fields
from bertforge.tokenizer import Tokenizer
from bertforge.train import budget, distributed, stacking
from bertforge.train.batch_choice import budget_batch
from bertforge.train.budget import BudgetPlan, deadline_for, plan_run, save_plan
from bertforge.train.candidates import candidate_sampler
from bertforge.train.cooccurrence import init_from_cooccurrences
from bertforge.train.electra import ElectraObjective, build_electra, electra_run_options, evaluate_electra
from bertforge.train.isotropy import isotropy, model_isotropy
from bertforge.train.loop import LoopOptions, Trainer, TrainResult, resolve_precision
from bertforge.train.objective import PretrainingObjective, evaluate_pretraining
from bertforge.train.recipe import BERT, Recipe, get_recipe, resolve
from bertforge.train.report import plot_metrics
from bertforge.train.resume import resume_history
from bertforge.train.rundir import RUN_CONFIG, claim_run_dir, write_run_config
from bertforge.train.stacking import HALF_DEPTH_DIR, half_depth, stack_layers
from bertforge.train.state import METRICS_FILE, checkpoints

__all__ = ["DataOptions", "ElectraOptions", "LoopOptions", "PretrainingObjective", "evaluate_pretraining", "pretrain",
           "resolve_model_config"]

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")


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


def pretrain(data_dir: str | Path, out_dir: str | Path, *, model: str = "mini",
             loop: LoopOptions | Mapping[str, Any] | None = None,
             data_options: DataOptions | Mapping[str, Any] | None = None, init: str | Path | None = None,
             resume: bool = False, max_seq_len: int | None = None, dropout: float | None = None,
             pre_layer_norm: bool | None = None, tie_embeddings: bool | None = None, minutes: float | None = None,
             warmup_fraction: float | None = None, recipe: Recipe | str | None = None,
             stack_fraction: float | None = None, stack_length_fraction: float | None = None,
             stack_mask_prob: float | None = None, bow_weight: float | None = None, mlm_candidates: int | None = None,
             embedding_init: str | None = None, objective: str = "mlm",
             electra: ElectraOptions | Mapping[str, Any] | None = None) -> TrainResult:
    """Pretrain a BERT with MLM (+ NSP unless `data_options.nsp` is False) on `data_dir` (made by `bertforge
    prepare`) into `out_dir`; with `objective="electra"`, as ELECTRA's discriminator (`electra` its options; see
    bertforge.electra for the run directory's layout): no NSP, stacking, bag-of-words loss or `init` then.

    `init` starts from a model directory's weights (the paper's second phase at length 512 starts from the
    first phase's model); the optimizer and schedule start fresh. `resume` continues exactly from the last
    checkpoint in `out_dir`. `dropout` overrides the model's dropout while pretraining (the saved config keeps
    its own); `pre_layer_norm` builds a new model with pre-LN layers, `tie_embeddings` False one whose masked-LM
    decoder is a matrix of its own. `minutes` replaces `loop.steps` by the steps that end at that wall time
    (budget.py), `warmup_fraction` of them warmup (None: keep `loop.warmup_steps`). `bow_weight` > 0 adds that
    weight of a bag-of-words loss on [CLS]; `mlm_candidates` K > 0 makes the masked-LM a sampled softmax over K
    drawn words (both `PretrainingObjective`). `embedding_init` "cooccurrence" starts a new model's word embeddings
    (not `init`'s) from the training split's co-occurrence statistics (cooccurrence.py), "random" as usual.

    `recipe` (a name or a Recipe, recorded in run_config.json) gives what the call leaves unset
    (`bertforge.train.recipe.resolve`): the options here left None, and the loop's batch size, learning rate,
    warmup, betas and weight decay and the data's masking rate and NSP, unless `loop` or `data_options` is an
    instance, which is used as it is; a mapping of some of their fields (`loop={"batch_size": 64}`) sets those,
    the recipe and the class's defaults the rest. Without a recipe the paper's, `bert`, does (recorded as none).

    `stack_fraction` F > 0 (a new model only) stacks (stacking.py): a model of half the depth is pretrained for
    the first F of the steps or minutes in `out_dir/half-depth/`, then its layers are copied on top of
    themselves and the full-depth model is pretrained for the rest in `out_dir`, with a warmup and decay of its
    own. Both stages read the data from its start, as the measured runs did. `stack_length_fraction` < 1 trains
    the first stage on sequences that much shorter (at least 8 tokens), as many more a batch (the same tokens a
    step): the half-depth model leaves the masked-LM's early plateau sooner; `stack_mask_prob` its masking rate.
    """
    out_dir = Path(out_dir)
    explicit = dict(dropout=dropout, pre_ln=pre_layer_norm, tie_embeddings=tie_embeddings,
                    stack_fraction=stack_fraction, stack_length_fraction=stack_length_fraction,
                    stack_mask_prob=stack_mask_prob, bow_weight=bow_weight, mlm_candidates=mlm_candidates,
                    embedding_init=embedding_init)
    electra_options = electra_run_options(objective, electra, explicit, init)
    if electra_options is not None and not isinstance(data_options, DataOptions):
        data_options = {"nsp": False, **given_fields(data_options)}
    loop, data_options, values = apply_recipe(recipe, loop, data_options, minutes, explicit)
    if electra_options is not None and data_options.nsp:
        raise BertforgeError("--nsp is not available with --objective electra (it fills each sequence): drop it")
    stage = _Stage(data_dir=data_dir, model=model, loop=loop, data_options=data_options, init=init, resume=resume,
                   max_seq_len=max_seq_len, dropout=values["dropout"], pre_layer_norm=values["pre_ln"],
                   tie_embeddings=values["tie_embeddings"], minutes=minutes,
                   warmup_fraction=values["warmup_fraction"] if warmup_fraction is None
                   else warmup_fraction, recipe=get_recipe(recipe) if recipe is not None else None,
                   bow_weight=values["bow_weight"], mlm_candidates=values["mlm_candidates"], electra=electra_options,
                   embedding_init=values["embedding_init"])
    try:
        return _run_stages(out_dir, stage, values)
    finally:
        distributed.teardown()


def _run_stages(out_dir: Path, stage: _Stage, values: Mapping[str, Any]) -> TrainResult:
    """The run: one stage, or stacking's two (a new model with a stack fraction); a new MLM model's time budget at
    the recipe's batch for it (`budget_batch`)."""
    if stage.minutes is not None and stage.recipe is not None and stage.init is None and stage.electra is None:
        loop = budget_batch(stage.recipe, stage.loop, values, minutes=stage.minutes, data_dir=stage.data_dir,
                            model_config=partial(resolve_model_config, stage.model), max_seq_len=stage.max_seq_len,
                            out_dir=out_dir, resume=stage.resume)
        stage = dataclasses.replace(stage, loop=loop)
    if not values["stack_fraction"] or stage.init is not None:
        if stage.resume and (out_dir / HALF_DEPTH_DIR).is_dir():
            raise BertforgeError(f"the run in {out_dir} was stacked (it has {HALF_DEPTH_DIR}/): resume it with "
                                 f"the --stack-fraction it was started with ({RUN_CONFIG})")
        return _pretrain_stage(out_dir, stage)
    return _pretrain_stacked(out_dir, stage, values)


_LOOP_OPTIONS = ("batch_size", "lr", "warmup_steps", "betas", "weight_decay")  # the recipe's, of LoopOptions


def apply_recipe(recipe: Recipe | str | None, loop: LoopOptions | Mapping[str, Any] | None,
                 data_options: DataOptions | Mapping[str, Any] | None, minutes: float | None,
                 explicit: Mapping[str, Any]) -> tuple[LoopOptions, DataOptions, dict[str, Any]]:
    """`pretrain`'s loop and data options and the recipe options' values (`recipe.resolve`) for `recipe` (None:
    `bert`), the options given winning: `explicit` (by command-line name, None: not given) and the fields `loop`
    and `data_options` set. An option class instance is used as it is."""
    loop_given, data_given = given_fields(loop), given_fields(data_options)
    given = {**loop_given, "mask_prob": data_given.get("masked_lm_prob"), "nsp": data_given.get("nsp"), **explicit}
    values = resolve(recipe if recipe is not None else BERT, given, minutes=minutes)
    values["batch_given"] = isinstance(loop, LoopOptions) or any(given.get(k) is not None for k in ("batch_size", "lr"))
    if values["embedding_init"] not in EMBEDDING_INITS:
        raise BertforgeError(f"unknown embedding_init {values['embedding_init']!r}; choose "
                             f"{' or '.join(EMBEDDING_INITS)}")
    if not isinstance(loop, LoopOptions):
        if values["steps"] is None:
            raise BertforgeError("pretrain needs the run's length: the loop's steps, or a time budget (minutes)")
        loop = LoopOptions(**{**loop_given, **{k: values[k] for k in _LOOP_OPTIONS}, "steps": values["steps"]})
    if not isinstance(data_options, DataOptions):
        data_options = DataOptions(**{**data_given, "masked_lm_prob": values["mask_prob"], "nsp": values["nsp"]})
    return loop, data_options, values


@dataclass
class _Stage:
    """One pretraining run into a directory (see `pretrain`): a whole run, or one of stacking's two stages.
    `half` halves the new model's depth and `stack_init` doubles the `init` model's (`stack` is recorded in
    run_config.json); `allow` names entries of the directory that do not make it a used one (the first stage's,
    for the second)."""

    data_dir: str | Path
    model: str
    loop: LoopOptions
    data_options: DataOptions
    init: str | Path | None
    resume: bool
    max_seq_len: int | None
    dropout: float | None
    pre_layer_norm: bool
    tie_embeddings: bool
    minutes: float | None
    warmup_fraction: float | None
    recipe: Recipe | None
    bow_weight: float
    mlm_candidates: int = 0
    electra: ElectraOptions | None = None  # the ELECTRA objective's options; None: masked-LM
    embedding_init: str = "random"  # a new model's word embeddings: "random" or "cooccurrence" (cooccurrence.py)
    half: bool = False
    stack_init: bool = False
    stack: dict | None = None
    label: str = ""
    allow: tuple[str, ...] = ()


def _pretrain_stacked(out_dir: Path, stage: _Stage, values: Mapping[str, Any]) -> TrainResult:
    """A stacked run (`values`: the recipe options' values, `recipe.resolve`)."""
    started = budget.now()
    first, second = stacking.stages(out_dir, model=stage.model, loop=stage.loop, minutes=stage.minutes,
                                    data_dir=stage.data_dir, max_seq_len=stage.max_seq_len, resume=stage.resume,
                                    fraction=values["stack_fraction"], length_fraction=values["stack_length_fraction"],
                                    data_options=stage.data_options, mask_prob=values["stack_mask_prob"])
    d = distributed.setup(stage.loop.device)
    first_dir = out_dir / HALF_DEPTH_DIR
    if (first_dir / WEIGHTS_NAME).is_file():
        if d.is_main:
            print(f"reusing the half-depth stage in {first_dir}", flush=True)
    else:
        _pretrain_stage(first_dir, dataclasses.replace(stage, **first))
    result = _pretrain_stage(out_dir, dataclasses.replace(stage, **second))
    if d.is_main:
        took = (budget.now() - started) / 60
        spent = f" of a {stage.minutes:g}-minute budget" if stage.minutes is not None else ""
        print(f"stacked pretraining took {took:.1f} min{spent} (this process): half depth in {first_dir}, "
              f"then {result.step:,} steps at full depth", flush=True)
    return result


def _pretrain_stage(out_dir: Path, s: _Stage) -> TrainResult:
    """One pretraining run into `out_dir`: claim it, build the model, plan a budget, record the run, train."""
    started = budget.now()
    d = distributed.setup(s.loop.device)
    run_dir = None
    try:
        resolve_precision(s.loop.precision, d.device)  # a refused precision before the directory is claimed
        # One run, one process per directory: the main process claims it, and every rank stops if it cannot.
        refusal = None
        if d.is_main:
            try:
                run_dir = claim_run_dir(out_dir, resume=s.resume, allow=s.allow)
            except BertforgeError as e:
                refusal = e
        if distributed.any_rank(refusal is not None, d):
            raise refusal or BertforgeError(f"--out {out_dir} was refused (see the main process's error)")
        if s.resume:
            _check_objective(out_dir, s.electra is not None)
        data = _TrainerData(s.data_dir, s.data_options, s.max_seq_len, d)
        net, config = _build_model(s, data.train, d)
        seed = s.data_options.seed
        objective = ElectraObjective(s.electra.discriminator_weight, seed=seed) if s.electra else \
            PretrainingObjective(nsp=s.data_options.nsp, bow_weight=s.bow_weight, is_special=data.train.is_special,
                                 candidates=candidate_sampler(data.train, s.mlm_candidates, seed, s.loop.batch_size))
        micro, accum = s.loop.accumulation(d.world_size)
        evaluate = _validation(data, s.data_options, micro, d, objective)
        loop, plan = s.loop, None
        if s.minutes is not None:
            plan, loop = plan_run(loop, minutes=s.minutes, warmup_fraction=s.warmup_fraction, out_dir=out_dir,
                                  resume=s.resume, started=started, dist=d, model=net,
                                  batches=data.train.batches(micro), objective=objective, accum=accum,
                                  evaluate=evaluate, continuing=s.stack_init)
        run_config = _run_config(s, config, loop, data.train, plan, d)
        resumes = resume_history(out_dir, run_config, s.minutes, verbose=d.is_main) if s.resume else []
        if d.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            if plan is not None:
                save_plan(out_dir, plan)
            write_run_config(out_dir, **run_config, resumes=resumes)
        trainer = Trainer(net, data, objective, loop, out_dir, evaluate=evaluate,
                          save_model=_model_saver(Path(s.data_dir) / "tokenizer"), dist=d, resume=s.resume,
                          deadline=deadline_for(plan, started) if plan is not None else None)
        result = trainer.run()
        if d.is_main:
            _report(out_dir, s, plan, result, started)
        distributed.barrier(d)  # the other ranks wait for rank 0's writes: gloo aborts a peer that leaves early
        return result
    finally:
        if run_dir is not None:
            run_dir.release()


def _check_objective(out_dir: Path, electra: bool) -> None:
    """Refuse to resume a run with the other objective: its checkpoints hold other models (an ELECTRA one has the
    replaced-token head), which would be set aside as unreadable or loaded with fresh heads."""
    found = checkpoints(out_dir)
    if found and (found[-1][1] / HEAD_FILE).is_file() != electra:
        was = "mlm" if electra else "electra"
        raise BertforgeError(f"the run in {out_dir} was trained with --objective {was}: resume it with --objective "
                             f"{was}, or start a new run in a new --out")


class _TrainerData:
    """The prepared data's splits for this process; `batches` is what `Trainer` reads its training batches from
    (a position dict from a checkpoint, or none, and the data-loading workers)."""

    def __init__(self, data_dir: str | Path, options: DataOptions, max_seq_len: int | None, d: distributed.Dist):
        self.data_dir, self.options, self.max_seq_len, self.dist = data_dir, options, max_seq_len, d
        self.train = self.split("train")

    def split(self, name: str) -> PretrainingData:
        o, d = self.options, self.dist
        return PretrainingData(self.data_dir, name, max_seq_len=self.max_seq_len, short_seq_prob=o.short_seq_prob,
                               masked_lm_prob=o.masked_lm_prob, max_predictions_per_seq=o.max_predictions_per_seq,
                               whole_word_mask=o.whole_word_mask, dupe_factor=o.dupe_factor, seed=o.seed,
                               rank=d.rank, world_size=d.world_size, nsp=o.nsp)

    def batches(self, micro_batch_size: int, position: dict | None = None):
        return self.train.batches(micro_batch_size, position=position or 0, num_workers=self.options.num_workers)


def _build_model(s: _Stage, train: PretrainingData, d: distributed.Dist) -> tuple[nn.Module, BertConfig]:
    """The model to pretrain: `init`'s (checked against the data's tokenizer; stacked for the second stage), or a
    new one of `model`'s config (pre-LN, half depth as asked, its word embeddings as `embedding_init` says); with
    the pretraining dropout set."""
    tokenizer = train.tokenizer
    config = resolve_model_config(s.model, tokenizer.vocab_size, train.max_seq_len)
    if s.init is not None:
        net = BertForPreTraining.from_pretrained(s.init, verbose=d.is_main)
        if net.config.vocab_size != tokenizer.vocab_size:
            raise BertforgeError(f"--init {s.init} has vocab_size {net.config.vocab_size} but the data's "
                                 f"tokenizer has {tokenizer.vocab_size}: prepare the data with its tokenizer")
        if (Path(s.init) / "vocab.txt").is_file():  # a bare config + weights directory has no tokenizer to check
            init_fp = Tokenizer.from_pretrained(s.init).fingerprint
            if init_fp != tokenizer.fingerprint:
                raise BertforgeError(f"--init {s.init} was trained with tokenizer {init_fp}, but --data "
                                     f"{s.data_dir} was prepared with tokenizer {tokenizer.fingerprint}: prepare the "
                                     f"corpus with the model's tokenizer (`bertforge prepare --tokenizer {s.init}`)")
        if s.stack_init:
            net = stack_layers(net)
        config = net.config
    else:
        if s.pre_layer_norm:
            config = config.replace(pre_layer_norm=True)
        if not s.tie_embeddings:
            config = config.replace(tie_word_embeddings=False)
        if s.half:
            config = half_depth(config)
        torch.manual_seed(s.loop.seed)
        net = BertForPreTraining(config) if s.electra is None else build_electra(config, s.electra)
        if s.embedding_init == "cooccurrence":  # also when resuming: a run cut before its first checkpoint restarts
            words = net.discriminator if isinstance(net, ElectraForPreTraining) else net.bert
            init_from_cooccurrences(words.embeddings.word_embeddings, train, config, verbose=d.is_main)
    tokenizer.check_compatible(config)
    if s.dropout is not None:
        net.set_dropout(s.dropout)
    if s.electra is None and not s.data_options.nsp:  # no gradient reaches them: frozen, DDP waits for none
        for p in (*net.bert.pooler.parameters(), *net.cls.seq_relationship.parameters()):
            p.requires_grad_(False)
    return net, config


def _validation(data: _TrainerData, opts: DataOptions, micro: int, d: distributed.Dist, objective: Any):
    """The evaluation on fixed validation batches, or None (no val split, or eval_batches 0)."""
    if opts.eval_batches <= 0:
        return None
    val_docs = int(data.train.manifest.get("splits", {}).get("val", {}).get("documents", 0))
    if not val_docs:
        return None
    # every rank evaluates its share of each global batch: the ranks' batches k together are the one-process
    # batch k, so the figures do not depend on the number of processes
    it = data.split("val").batches(micro)
    val_batches = [next(it) for _ in range(opts.eval_batches)]
    if val_docs == 1 and opts.nsp and d.is_main:
        print("the val split has a single document, so no NotNext pairs: NSP accuracy is not reported "
              "(prepare with a larger --val-fraction to have it)")
    # with the embeddings' isotropy (train/isotropy.py): cheap, and the collapse it tracks is issue 48's
    if isinstance(objective, ElectraObjective):  # the discriminator's embeddings, which the generator shares
        return lambda m: {**evaluate_electra(m, val_batches, d.device, objective=objective, dist=d),
                          **isotropy(m.discriminator.embeddings.word_embeddings.weight)}
    return lambda m: {**evaluate_pretraining(m, val_batches, d.device, nsp=opts.nsp and val_docs > 1, dist=d),
                      **model_isotropy(m)}


def _model_saver(tok_dir: Path):
    def save_model(m: nn.Module, path: Path) -> None:
        unwrap(m).save_pretrained(path)
        # ELECTRA's generator is a model directory of its own, with the shared tokenizer
        for where in (path, path / GENERATOR_DIR) if (path / GENERATOR_DIR).is_dir() else (path,):
            for name in TOKENIZER_FILES:
                if (tok_dir / name).is_file():
                    shutil.copyfile(tok_dir / name, where / name)

    return save_model


def _run_config(s: _Stage, config: BertConfig, loop: LoopOptions, train: PretrainingData, plan: BudgetPlan | None,
                d: distributed.Dist) -> dict:
    return dict(command="pretrain", data=str(s.data_dir), model=config.to_dict(), loop=loop,
                data_options=s.data_options, max_seq_len=train.max_seq_len, init=str(s.init) if s.init else None,
                world_size=d.world_size, recipe=s.recipe.to_dict() if s.recipe else None, dropout=s.dropout,
                bow_weight=s.bow_weight, mlm_candidates=s.mlm_candidates, embedding_init=s.embedding_init,
                stack=s.stack,
                budget=asdict(plan) if plan else None,
                manifest={k: v for k, v in train.manifest.items() if not isinstance(v, list)},
                **({"objective": "electra", "electra": asdict(s.electra)} if s.electra is not None else {}))


def _report(out_dir: Path, s: _Stage, plan: BudgetPlan | None, result: TrainResult, started: float) -> None:
    plot_metrics(out_dir / METRICS_FILE, out_dir / "training_curves.png",
                 earlier=Path(s.init) / METRICS_FILE if s.stack_init else None)
    if plan is not None:
        took = (budget.now() - started) / 60
        print(f"{s.label}pretraining took {took:.1f} min of a {plan.minutes:g}-minute budget: {result.step:,} "
              f"steps (planned {plan.steps:,} at the start)", flush=True)
