"""Options declared once (bertforge.options) and the command lines built from them: every library option a
command runs with is on its command line, with its help and default; the command line wins over a `--config`
file, which wins over the recipe; building the parser does not import torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import bertforge.cpu
from bertforge.cli import build_parser
from bertforge.commands.arguments import build_args, options_from
from bertforge.commands.train import pretrain_config
from bertforge.errors import BertforgeError
from bertforge.options import PRECISIONS, DataOptions, DemoOptions, FinetuneOptions, LoopOptions
from bertforge.train.loop import resolve_precision

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)

# The option classes each command runs its library entry point with.
LIBRARY_OPTIONS = {"pretrain": (LoopOptions, DataOptions), "finetune": (FinetuneOptions,), "demo": (DemoOptions,)}
REQUIRED = {"pretrain": ["--data", "d", "--out", "o"],
            "finetune": ["--task", "sst2", "--data", "d", "--init", "m", "--out", "o"], "demo": []}
# Options the code that makes the class sets, never the user.
# fine-tuning: the task's main metric, and its --layer-lr-decay (a FinetuneOptions option)
LIBRARY_ONLY = {(LoopOptions, "best_metric"), (LoopOptions, "layer_lr_decay")}
# Where a command, given no options, runs with other values than the library's defaults: pretrain has its own
# --steps and one --seed for the loop and the data, and its default recipe (bert) fills in the batch size and the
# warmup (1% of the steps), which the library requires or sets for the paper's 1M steps.
COMMAND_DEFAULTS = {("pretrain", LoopOptions, "steps"): 10000, ("pretrain", LoopOptions, "seed"): 12345,
                    ("pretrain", LoopOptions, "batch_size"): 256, ("pretrain", LoopOptions, "warmup_steps"): 100}
OWN_HELP = {("pretrain", "seed")}  # pretrain's one --seed, for LoopOptions's and DataOptions' seeds, says so


def subparser(command: str) -> argparse.ArgumentParser:
    actions = build_parser()._subparsers._group_actions
    return next(a for a in actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def resolved(argv: list[str]):
    """The arguments of `bertforge ARGV`, as the command receives them."""
    ns = build_parser().parse_args(argv)
    return build_args(ns._command.args, ns)


def library_options(command: str, args) -> dict[type, object]:
    """The option class instances the command would run its entry point with."""
    if command == "pretrain":
        config = pretrain_config(args)
        return {LoopOptions: config.loop, DataOptions: config.data}
    if command == "finetune":
        return {FinetuneOptions: options_from(FinetuneOptions, args)}
    return {DemoOptions: args}


@pytest.mark.parametrize("command", sorted(LIBRARY_OPTIONS))
def test_every_library_option_of_a_command_is_on_its_command_line_with_its_help_and_default(command):
    flags = {name: action for action in subparser(command)._actions for name in action.option_strings}
    ran_with = library_options(command, resolved([command, *REQUIRED[command]]))
    for cls in LIBRARY_OPTIONS[command]:
        for f in dataclasses.fields(cls):
            if (cls, f.name) in LIBRARY_ONLY:
                assert "help" not in f.metadata, f"{cls.__name__}.{f.name} is declared for the command line"
                continue
            flag = "--" + (f.metadata.get("flag") or f.name).replace("_", "-")
            assert flag in flags, f"{cls.__name__}.{f.name} is not on `bertforge {command}`'s command line"
            assert (command, f.name) in OWN_HELP or f.metadata["help"] in flags[flag].help
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            expected = COMMAND_DEFAULTS.get((command, cls, f.name), default)
            assert getattr(ran_with[cls], f.name) == expected, f"{flag} of {command}"


def test_the_command_line_wins_over_the_config_file_which_wins_over_the_recipe(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"recipe": "budget", "steps": 200, "lr": 5e-4, "nsp": True, "optimizer": "lamb",
                                  "mask_prob": 0.2, "workers": 2}))
    base = ["pretrain", "--data", "d", "--out", "o", "--config", str(config)]
    # The command line gives the declared defaults: a value equal to the default still wins over the file.
    args = resolved([*base, "--steps", "10000", "--no-nsp", "--optimizer", "adamw", "--workers", "0"])
    assert (args.recipe, args.steps, args.lr, args.nsp, args.optimizer, args.workers) == (
        "budget", 10000, 5e-4, False, "adamw", 0)
    config = pretrain_config(args)
    loop, data = config.loop, config.data
    assert (loop.steps, loop.lr, loop.optimizer, loop.batch_size, loop.betas) == (10000, 5e-4, "adamw", 16, (0.9, 0.98))
    assert (data.nsp, data.masked_lm_prob, data.num_workers) == (False, 0.2, 0)
    assert config.model.pre_layer_norm is True and config.model.dropout == 0.0  # the file's recipe, budget
    assert config.model.embedding_init == "cooccurrence"
    # Without the flags the file's values hold.
    args = resolved(base)
    assert (args.steps, args.nsp, args.optimizer, args.workers) == (200, True, "lamb", 2)


def test_a_pair_given_as_one_value_is_refused_in_one_line():
    with pytest.raises(BertforgeError, match=r"^--betas 0.9: give 2 values, e.g. 0.9 0.999$"):
        pretrain_config(resolved(["pretrain", "--data", "d", "--out", "o", "--betas", "0.9"]))


def test_precision_names_are_the_ones_the_loop_resolves(monkeypatch):
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: True)  # bf16 is refused on CPUs without it
    for command in ("pretrain", "finetune"):
        action = next(a for a in subparser(command)._actions if "--precision" in a.option_strings)
        assert tuple(action.choices) == PRECISIONS
    for name in PRECISIONS:
        assert resolve_precision(name, torch.device("cpu")) in ("fp32", "bf16")
    with pytest.raises(BertforgeError, match="choose one of auto, fp32, bf16"):
        resolve_precision("fp16", torch.device("cpu"))


def test_building_the_command_line_does_not_import_torch():
    code = "import sys\nfrom bertforge.cli import build_parser\nbuild_parser()\nprint('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr
