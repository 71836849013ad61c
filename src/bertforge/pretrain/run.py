"""Pretraining: MLM + NSP (or ELECTRA) on prepared data, through the one training loop, from one `PretrainConfig`."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bertforge.config import PRESETS, BertConfig
from bertforge.data.loader import PretrainingData
from bertforge.dropout import load_kernels
from bertforge.electra import GENERATOR_DIR, HEAD_FILE, ElectraForPreTraining
from bertforge.errors import BertforgeError
from bertforge.model_files import WEIGHTS_NAME, unwrap
from bertforge.models import BertForPreTraining
from bertforge.options import DataOptions, cli_name
from bertforge.pretrain import budget, stacking
from bertforge.pretrain.budget import BudgetPlan, Timing, choose_batch, deadline_for, plan_run, save_plan
from bertforge.pretrain.config import PretrainConfig
from bertforge.pretrain.cooccurrence import init_from_cooccurrences, svd_solver
from bertforge.pretrain.electra import ElectraObjective, build_electra, evaluate_electra
from bertforge.pretrain.isotropy import isotropy, model_isotropy
from bertforge.pretrain.objectives import PretrainingObjective, candidate_sampler, evaluate_pretraining
from bertforge.pretrain.recipe import get_recipe, recipe_config
from bertforge.pretrain.stacking import HALF_DEPTH_DIR, Role, half_depth, stack_layers
from bertforge.tokenizer import Tokenizer
from bertforge.train import distributed
from bertforge.train.checkpoints import METRICS_FILE, checkpoints
from bertforge.train.loop import Hooks, LoopOptions, Trainer, TrainResult, resolve_precision
from bertforge.train.report import plot_metrics
from bertforge.train.rundir import RUN_CONFIG, claim_run_dir, resume_history, write_run_config

__all__ = ["PretrainConfig", "pretrain", "recipe_config", "resolve_model_config"]

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


def pretrain(config: PretrainConfig) -> TrainResult:
    """Pretrain the model `config` describes on its prepared data into its run directory and return how it ended.
    Make the config with a recipe: `pretrain(recipe_config("budget", data="data/", out="runs/tiny", model="tiny",
    minutes=30))`; `recipe_config("bert", ...)`, the paper's, is the default of the command line.

    With a stacking fraction F > 0 (a new model only, stacking.py) a model of half the depth is pretrained for the
    first F of the steps or minutes in `out_dir/half-depth/`, on sequences `stacking.length_fraction` as long (as
    many more a batch), then its layers are copied on top of themselves and the full-depth model trains for the rest
    in `out_dir`, with a warmup and decay of its own; both stages read the data from its start. With a time budget
    (`budget.minutes`) the steps are planned from timed ones so the schedule ends at the deadline (budget.py), at
    the larger batch the config names when the minutes buy enough steps (`budget.choose_batch`). The run directory
    records the resolved configuration in run_config.json, which `resume` compares against."""
    if config.model.embedding_init == "cooccurrence":
        svd_solver()  # its import, outside a time budget's clock
    if config.budget.minutes is not None:
        load_kernels(config.loop.device)  # outside the clock too
    try:
        if config.budget.larger_batch is not None:
            config = choose_batch(config, model_config=resolve_model_config)
        out_dir = Path(config.out_dir)
        if not config.stacking.fraction:
            if config.resume and (out_dir / HALF_DEPTH_DIR).is_dir():
                raise BertforgeError(f"the run in {out_dir} was stacked (it has {HALF_DEPTH_DIR}/): resume it with "
                                     f"the --stack-fraction it was started with ({RUN_CONFIG})")
            return _pretrain_stage(config, Role())
        return _pretrain_stacked(out_dir, config)
    finally:
        distributed.teardown()


def _pretrain_stacked(out_dir: Path, config: PretrainConfig) -> TrainResult:
    started = budget.now()
    (first, first_role), (second, second_role) = stacking.stages(config)
    d = distributed.setup(config.loop.device)
    first_dir = out_dir / HALF_DEPTH_DIR
    if (first_dir / WEIGHTS_NAME).is_file():
        if d.is_main:
            print(f"reusing the half-depth stage in {first_dir}", flush=True)
    else:
        _pretrain_stage(first, first_role)
    result = _pretrain_stage(second, second_role)
    if d.is_main:
        took = (budget.now() - started) / 60
        minutes = config.budget.minutes
        spent = f" of a {minutes:g}-minute budget" if minutes is not None else ""
        print(f"stacked pretraining took {took:.1f} min{spent} (this process): half depth in {first_dir}, "
              f"then {result.step:,} steps at full depth", flush=True)
    return result


def _pretrain_stage(c: PretrainConfig, role: Role) -> TrainResult:
    """One pretraining run into its directory: claim it, build the model, plan a budget, record the run, train."""
    started, out_dir = budget.now(), Path(c.out_dir)
    d = distributed.setup(c.loop.device)
    run_dir = None
    try:
        resolve_precision(c.loop.precision, d.device)  # a refused precision before the directory is claimed
        # One run, one process per directory: the main process claims it, and every rank stops if it cannot.
        run_dir = distributed.main_decides(lambda: claim_run_dir(out_dir, resume=c.resume, allow=role.allow), d,
                                           f"--out {out_dir} was refused (see the main process's error)")
        if c.resume:
            _check_objective(out_dir, c.objective.kind == "electra")
        data = _TrainerData(c, d)
        net, model_config = _build_model(c, role, data.train, d)
        objective = _objective(c, data.train)
        micro, accum = c.loop.accumulation(d.world_size)
        evaluate = _validation(data, c.data, micro, d, objective)
        loop, plan = c.loop, None
        if c.budget.minutes is not None:
            plan, loop = plan_run(loop, c.budget, Timing(out_dir=out_dir, resume=c.resume, started=started, dist=d,
                                                         continuing=role.stack_from is not None),
                                  model=net, batches=data.train.batches(micro), objective=objective, accum=accum,
                                  evaluate=evaluate)
        run_config = _run_config(c, role, model_config, loop, data.train, plan, d)
        resumes = resume_history(out_dir, run_config, c.budget.minutes, verbose=d.is_main) if c.resume else []
        if d.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            if plan is not None:
                save_plan(out_dir, plan)
            write_run_config(out_dir, **run_config, resumes=resumes)
        hooks = Hooks(evaluate=evaluate, save_model=_model_saver(Path(c.data_dir) / "tokenizer"),
                      deadline=deadline_for(plan, started) if plan is not None else None)
        trainer = Trainer(net, data, objective, loop, out_dir, hooks=hooks, dist=d, resume=c.resume)
        result = trainer.run()
        if d.is_main:
            _report(out_dir, role, plan, result, started)
        distributed.barrier(d)  # the other ranks wait for rank 0's writes: gloo aborts a peer that leaves early
        return result
    finally:
        if run_dir is not None:
            run_dir.release()


def _objective(c: PretrainConfig, train: PretrainingData) -> Any:
    """What the run optimises: ELECTRA's loss, or the masked-LM's (+ NSP, + bag of words, sampled as asked)."""
    seed = c.data.seed
    if c.objective.kind == "electra":
        return ElectraObjective(c.objective.electra.discriminator_weight, seed=seed)
    return PretrainingObjective(nsp=c.data.nsp, bow_weight=c.objective.bow_weight, is_special=train.is_special,
                                candidates=candidate_sampler(train, c.objective.mlm_candidates, seed,
                                                             c.loop.batch_size))


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

    def __init__(self, c: PretrainConfig, d: distributed.Dist):
        self.data_dir, self.options, self.max_seq_len, self.dist = c.data_dir, c.data, c.model.max_seq_len, d
        self.train = self.split("train")

    def split(self, name: str) -> PretrainingData:
        o, d = self.options, self.dist
        return PretrainingData(self.data_dir, name, o, max_seq_len=self.max_seq_len, rank=d.rank,
                               world_size=d.world_size)

    def batches(self, micro_batch_size: int, position: dict | None = None):
        return self.train.batches(micro_batch_size, position=position or 0,
                                  num_workers=loader_workers(self.options.num_workers, self.dist.device))


def loader_workers(workers: int | None, device: torch.device) -> int:
    """`--workers`, by default 2 on a GPU (there a step with two workers took 72.8 ms, 87.8 with the batches masked
    in a thread beside the training: docs/benchmarks.md) and 0 on the CPU, whose cores train."""
    if workers is not None:
        return workers
    return 2 if device.type == "cuda" else 0


def _build_model(c: PretrainConfig, role: Role, train: PretrainingData,
                 d: distributed.Dist) -> tuple[nn.Module, BertConfig]:
    """The model to pretrain: `init`'s or the first stage's (checked against the data's tokenizer; stacked for the
    second stage), or a new one of the model's config (pre-LN, half depth as asked, its word embeddings as
    `embedding_init` says); with the pretraining dropout set."""
    m, tokenizer = c.model, train.tokenizer
    config = resolve_model_config(m.name, tokenizer.vocab_size, train.max_seq_len)
    init = role.stack_from or m.init
    if init is not None:
        net = _load_init(init, c.data_dir, tokenizer, d)
        if role.stack_from is not None:
            net = stack_layers(net)
        config = net.config
    else:
        if m.pre_layer_norm:
            config = config.replace(pre_layer_norm=True)
        if not m.tie_embeddings:
            config = config.replace(tie_word_embeddings=False)
        if role.half:
            config = half_depth(config)
        torch.manual_seed(c.loop.seed)
        net = BertForPreTraining(config) if c.objective.kind == "mlm" else build_electra(config, c.objective.electra)
        if m.embedding_init == "cooccurrence":  # also when resuming: a run cut before its first checkpoint restarts
            words = net.discriminator if isinstance(net, ElectraForPreTraining) else net.bert
            init_from_cooccurrences(words.embeddings.word_embeddings, train, config, verbose=d.is_main)
    tokenizer.check_compatible(config)
    if m.dropout is not None:
        net.set_dropout(m.dropout)
    if c.objective.kind == "mlm" and not c.data.nsp:  # no gradient reaches them: frozen, DDP waits for none
        for p in (*net.bert.pooler.parameters(), *net.cls.seq_relationship.parameters()):
            p.requires_grad_(False)
    return net, config


def _load_init(init: str | Path, data_dir: str, tokenizer: Tokenizer, d: distributed.Dist) -> BertForPreTraining:
    """`init`'s model, refused when its vocabulary is not the data's tokenizer's."""
    net = BertForPreTraining.from_pretrained(init, verbose=d.is_main)
    if net.config.vocab_size != tokenizer.vocab_size:
        raise BertforgeError(f"--init {init} has vocab_size {net.config.vocab_size} but the data's "
                             f"tokenizer has {tokenizer.vocab_size}: prepare the data with its tokenizer")
    if (Path(init) / "vocab.txt").is_file():  # a bare config + weights directory has no tokenizer to check
        init_fp = Tokenizer.from_pretrained(init).fingerprint
        if init_fp != tokenizer.fingerprint:
            raise BertforgeError(f"--init {init} was trained with tokenizer {init_fp}, but --data "
                                 f"{data_dir} was prepared with tokenizer {tokenizer.fingerprint}: prepare the "
                                 f"corpus with the model's tokenizer (`bertforge prepare --tokenizer {init}`)")
    return net


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
    # with the embeddings' isotropy (isotropy.py): cheap, and the collapse it tracks is what short runs suffer
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


def _run_config(c: PretrainConfig, role: Role, config: BertConfig, loop: LoopOptions, train: PretrainingData,
                plan: BudgetPlan | None, d: distributed.Dist) -> dict:
    """run_config.json: the resolved configuration as this stage runs it (what `--resume` compares)."""
    init = role.stack_from or c.model.init
    recipe = get_recipe(c.recipe).to_dict() if c.recipe is not None else None
    electra = {"objective": "electra", "electra": asdict(c.objective.electra)} if c.objective.kind == "electra" else {}
    return dict(command="pretrain", data=str(c.data_dir), model=config.to_dict(), loop=loop, data_options=c.data,
                max_seq_len=train.max_seq_len, init=str(init) if init else None, world_size=d.world_size,
                recipe=recipe, dropout=c.model.dropout, bow_weight=c.objective.bow_weight,
                mlm_candidates=c.objective.mlm_candidates, embedding_init=c.model.embedding_init, stack=role.stack,
                budget=asdict(plan) if plan else None,
                manifest={k: v for k, v in train.manifest.items() if not isinstance(v, list)}, spec=_spec(c), **electra)


def _spec(c: PretrainConfig) -> dict:
    """The model's, objective's and stacking's options by command-line name: a new option of theirs is recorded
    (and compared on --resume) without a line here."""
    return {cli_name(f): getattr(section, f.name) for section in (c.model, c.objective, c.stacking)
            for f in dataclasses.fields(section) if "help" in f.metadata}


def _report(out_dir: Path, role: Role, plan: BudgetPlan | None, result: TrainResult, started: float) -> None:
    plot_metrics(out_dir / METRICS_FILE, out_dir / "training_curves.svg",
                 earlier=role.stack_from / METRICS_FILE if role.stack_from is not None else None)
    if plan is not None:
        took = (budget.now() - started) / 60
        print(f"{role.label}pretraining took {took:.1f} min of a {plan.minutes:g}-minute budget: {result.step:,} "
              f"steps (planned {plan.steps:,} at the start)", flush=True)
