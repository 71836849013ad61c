"""Progressive stacking (Gong et al., 2019, "Efficient Training of BERT by Progressively Stacking"): pretrain a
model of half the depth first, then copy its layers on top of themselves and go on with the full depth.

Why it is here: at small compute the masked-LM spends its first steps on a plateau (predicting word frequencies)
that costs about the same number of *tokens* whatever the model's depth; a half-depth model pays those tokens at
about half the price. On this project's CPU, BERT-mini's budget recipe leaves the plateau after ~8 minutes, a
2-layer model of the same width after ~4.5; stacked into 4 layers it goes on from there
(docs/experiments/stacking.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from bertforge.bounds import MIN_SEQ_LEN
from bertforge.config import PRESETS, BertConfig
from bertforge.data.shards import read_manifest
from bertforge.errors import BertforgeError
from bertforge.models import BertForPreTraining
from bertforge.options import LoopOptions
from bertforge.pretrain.config import PretrainConfig
from bertforge.train import distributed
from bertforge.train.rundir import check_stack, used_dir_refusal

HALF_DEPTH_DIR = "half-depth"  # the first stage's run directory, inside the staged run's own


def check_stackable(layers: int | None) -> None:
    """Refuses a depth that cannot be halved (None: not known yet, nothing to check)."""
    if layers is not None and (layers < 2 or layers % 2):
        raise BertforgeError(f"stacking needs an even number of layers (the model has {layers}): use "
                             f"--stack-fraction 0 or a model with an even num_hidden_layers")


def half_depth(config: BertConfig) -> BertConfig:
    """The first stage's config: every size the same but half the layers; refuses an odd depth."""
    check_stackable(config.num_hidden_layers)
    return config.replace(num_hidden_layers=config.num_hidden_layers // 2)


def stack_layers(model: BertForPreTraining) -> BertForPreTraining:
    """A new model of twice `model`'s depth L: layer i and layer i + L both start as copies of `model`'s layer i
    (the paper's stacking: the trained stack placed on top of itself); embeddings, pooler and heads are copied."""
    layers = model.config.num_hidden_layers
    deep = BertForPreTraining(model.config.replace(num_hidden_layers=2 * layers))
    source = model.state_dict()
    state = {}
    for name in deep.state_dict():
        head, sep, rest = name.partition(".layer.")
        if sep and head.endswith("encoder"):
            index, _, tail = rest.partition(".")
            name_in_source = f"{head}.layer.{int(index) % layers}.{tail}"
        else:
            name_in_source = name
        state[name] = source[name_in_source].detach().clone()
    deep.load_state_dict(state)
    return deep


def model_depth(spec: str) -> int | None:
    """The number of layers `--model` asks for, when it can be read without the data (else None: the stage
    that builds the model reports the problem)."""
    if spec in PRESETS:
        return PRESETS[spec][0]
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    return BertConfig.from_json(path).num_hidden_layers if path.is_file() else None


def split(loop: LoopOptions, minutes: float | None, fraction: float) -> list[tuple[LoopOptions, float | None]]:
    """The two stages' loop settings and budgets: `fraction` of the steps (or minutes) for the first."""
    first = min(max(1, round(fraction * loop.steps)), loop.steps - 1) if loop.steps > 1 else 1
    stages = []
    for steps, share in ((first, fraction), (max(1, loop.steps - first), 1 - fraction)):
        warmup = min(round(loop.warmup_steps * steps / loop.steps), steps - 1)
        stages.append((dataclasses.replace(loop, steps=steps, warmup_steps=max(0, warmup)),
                       minutes * share if minutes is not None else None))
    return stages


def short_length(run_len: int, length_fraction: float) -> int:
    """The first stage's sequence length: `length_fraction` of the run's, at least MIN_SEQ_LEN, at most the run's."""
    return min(run_len, max(int(MIN_SEQ_LEN.lo), round(length_fraction * run_len)))


def short_stage(loop: LoopOptions, run_len: int, short_len: int) -> LoopOptions:
    """The first stage's loop at `short_len` (<= `run_len`): as many more sequences a batch and micro-batch, so a
    step takes about as many tokens as at the run's length (the same loop when the lengths are equal)."""
    def scale(n: int | None) -> int | None:
        return None if n is None else max(1, round(n * run_len / short_len))

    return dataclasses.replace(loop, batch_size=scale(loop.batch_size), micro_batch_size=scale(loop.micro_batch_size))


@dataclass(frozen=True)
class Role:
    """What a run directory is within its run: the whole run, or one of stacking's two stages. `half` halves the new
    model's depth; `stack_from` is the first stage's directory, whose model the second stacks to twice its depth;
    `stack` is recorded in run_config.json; `allow` names entries of the directory that do not make it a used one
    (the first stage's, for the second)."""

    half: bool = False
    stack_from: Path | None = None
    stack: dict | None = None
    label: str = ""
    allow: tuple[str, ...] = ()


def stages(c: PretrainConfig) -> tuple[tuple[PretrainConfig, Role], tuple[PretrainConfig, Role]]:
    """A stacked run's two stages, each a config derived from the run's `c` and its role: the first at half depth in
    out_dir/half-depth on shorter sequences (at the stacking's masking rate, if it has one), the second from its
    model stacked. Refuses, on every process, an odd depth, a used `out_dir`, and a resumed run asked for another
    split, budget, length or first stage's masking rate than it was started with."""
    check_stackable(model_depth(c.model.name))  # before either stage claims a directory
    out_dir, s, minutes = Path(c.out_dir), c.stacking, c.budget.minutes
    run_len = int(c.model.max_seq_len or read_manifest(Path(c.data_dir))["max_seq_len"])
    short_len = short_length(run_len, s.length_fraction)
    first_dir = out_dir / HALF_DEPTH_DIR
    stack = {"fraction": s.fraction, "minutes": minutes, "steps": None if minutes else c.loop.steps,
             "length_fraction": s.length_fraction, "mask_prob": s.mask_prob}

    def check() -> None:  # the stages claim their own directories; a used --out is refused before both
        refusal = check_stack(out_dir, stack, (out_dir, first_dir)) if c.resume else used_dir_refusal(out_dir)
        if refusal is not None:
            raise refusal

    distributed.main_decides(check, distributed.setup(c.loop.device),
                             f"--out {out_dir} was refused (see the main process's error)")
    (first_loop, first_minutes), (second_loop, second_minutes) = split(c.loop, minutes, s.fraction)
    first = c.replace(out_dir=str(first_dir), loop=short_stage(first_loop, run_len, short_len),
                      budget=dataclasses.replace(c.budget, minutes=first_minutes),
                      model=dataclasses.replace(c.model, max_seq_len=short_len), resume=c.resume and first_dir.is_dir(),
                      data=c.data if s.mask_prob is None else dataclasses.replace(c.data, masked_lm_prob=s.mask_prob))
    second = c.replace(loop=second_loop, budget=dataclasses.replace(c.budget, minutes=second_minutes))
    return ((first, Role(half=True, label="half depth: ", stack={**stack, "stage": "half depth"})),
            (second, Role(stack_from=first_dir, label="full depth: ", stack={**stack, "stage": "full depth"},
                          allow=(HALF_DEPTH_DIR,))))
