"""The inference engines' options, one `EngineOptions`: each combination that cannot run refused in one line, from
Python and from every inference command (before a model is loaded); the flags of predict, fill-mask, embed and
serve declared once, with the same defaults; and the options reaching the engines (a refused bf16, an int8 model,
auto's number format).

Models are conftest's tiny `mlm_dir` and `clf_dir`; a refusal names a model directory that does not exist, so an
engine that loaded anything before refusing would fail on that instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest
import torch

import bertforge.cpu
import bertforge.infer
from bertforge import BertforgeError
from bertforge.cli import build_parser, main
from bertforge.commands.arguments import build_args, options_from
from bertforge.infer import Encoder, EngineOptions, Int8Linear, MaskFiller, Predictor, predict_records
from bertforge.options import PRECISIONS, LoopOptions

# (options, the start of the one-line refusal): every combination EngineOptions refuses
REFUSED = [
    ({"precision": "fp16"}, "--precision 'fp16': use one of auto, fp32, bf16"),
    ({"quantize": "int4"}, "--quantize 'int4': only int8 is supported"),
    ({"backend": "tensorrt"}, "--backend 'tensorrt': use one of torch, onnx"),
    ({"quantize": "int8", "device": "cuda"}, "--quantize int8 runs on the CPU only, not --device cuda"),
    ({"quantize": "int8", "precision": "bf16"}, "--quantize int8 picks the number formats around its int8 products"),
    ({"backend": "onnx", "device": "cuda:1"}, "--backend onnx runs ONNX Runtime on the CPU, not --device cuda:1"),
    ({"backend": "onnx", "precision": "bf16"}, "--backend onnx runs fp32 or int8"),
]
COMMANDS = {"predict": ["--text", "a film"], "embed": ["--text", "a film"], "fill-mask": ["a [MASK] film"],
            "serve": []}
ENGINE_FLAGS = ("device", "precision", "quantize", "backend")


def dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def flags(options: dict) -> list[str]:
    return [word for name, value in options.items() for word in (f"--{name}", value)]


def resolved(argv: list[str]):
    ns = build_parser().parse_args(argv)
    return build_args(ns._command.args, ns)


def subparser(command: str) -> argparse.ArgumentParser:
    actions = build_parser()._subparsers._group_actions
    return next(a for a in actions if isinstance(a, argparse._SubParsersAction)).choices[command]


@pytest.mark.parametrize(("options", "message"), REFUSED, ids=lambda v: str(v)[:40])
def test_each_impossible_combination_is_one_error_in_python(options, message):
    with pytest.raises(BertforgeError, match="^" + re.escape(message)) as refused:
        EngineOptions(**options)
    assert "\n" not in str(refused.value)
    first, *rest = options.items()  # the options made one at a time: the last change is refused as well
    with pytest.raises(BertforgeError, match="^" + re.escape(message)):
        dataclasses.replace(EngineOptions(**dict([first])) if rest else EngineOptions(), **options)


@pytest.mark.parametrize(("command", "options", "message"),
                         [(command, options, message) for command in sorted(COMMANDS)
                          for options, message in REFUSED[3:]
                          if command != "fill-mask" or "backend" not in options],  # fill-mask: no --backend
                         ids=lambda v: str(v)[:40])
def test_each_impossible_combination_is_one_error_line_from_every_command(command, options, message, tmp_path,
                                                                          capsys):
    absent = tmp_path / "no-model"  # refused before anything is read from it
    assert main([command, "--model", str(absent), *COMMANDS[command], *flags(options)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize(("command", "flag", "value"),
                         [(command, flag, value) for command in sorted(COMMANDS)
                          for flag, value in (("--precision", "fp16"), ("--quantize", "int4"), ("--backend", "tf"))
                          if command != "fill-mask" or flag != "--backend"])
def test_a_value_outside_the_choices_is_one_error_line(command, flag, value, tmp_path, capsys):
    assert main([command, "--model", str(tmp_path), *COMMANDS[command], flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: argument {flag}: invalid choice: '{value}'") and err.count("\n") == 1


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_engine_flags_are_engine_options_own_with_their_defaults(command):
    """Each command's --device/--precision/--quantize/--backend is EngineOptions' field (help, choices, default),
    and the command hands them on as one EngineOptions; fill-mask has all but --backend."""
    actions = {a.dest: a for a in subparser(command)._actions}
    fields = {f.name: f for f in dataclasses.fields(EngineOptions)}
    for name in ENGINE_FLAGS:
        if command == "fill-mask" and name == "backend":
            assert name not in actions
            continue
        assert actions[name].help.startswith(fields[name].metadata["help"])
        assert actions[name].choices == fields[name].metadata["choices"]
    argv = [command, "--model", "m", *COMMANDS[command]]
    engine = (lambda args: args.engine()) if command == "serve" else (lambda args: options_from(EngineOptions, args))
    assert engine(resolved(argv)) == EngineOptions() == EngineOptions(None, "fp32", None, "torch")
    given = {"device": "cpu", "precision": "auto", "quantize": "int8"}
    assert engine(resolved([*argv, *flags(given)])) == EngineOptions(**given)


def test_training_and_inference_precisions_are_one_vocabulary():
    loop = next(f for f in dataclasses.fields(LoopOptions) if f.name == "precision")
    engine = next(f for f in dataclasses.fields(EngineOptions) if f.name == "precision")
    assert tuple(loop.metadata["choices"]) == tuple(engine.metadata["choices"]) == PRECISIONS
    assert (loop.default, engine.default) == ("auto", "fp32")  # training defaults to auto, inference to fp32
    assert "auto" in (EngineOptions.__doc__ or "") and "training's auto" in (EngineOptions.__doc__ or "")


def test_a_bf16_the_cpu_would_only_emulate_is_refused_by_every_engine(mlm_dir, clf_dir, monkeypatch):
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: False)
    bf16 = EngineOptions(precision="bf16")  # the options alone cannot know the CPU: the engine refuses
    for make in (lambda: Encoder(mlm_dir, bf16), lambda: MaskFiller(mlm_dir, bf16), lambda: Predictor(clf_dir, bf16),
                 lambda: predict_records(clf_dir, [{"text": "good"}], bf16)):
        with pytest.raises(BertforgeError, match="^--precision bf16: this CPU has no bf16 dot products"):
            make()
    assert dtype(Encoder(mlm_dir, EngineOptions(precision="auto")).model) == torch.float32  # auto on such a CPU


@pytest.mark.skipif(not bertforge.cpu.has_native_bf16(), reason="this CPU has no bf16 dot products")
def test_auto_and_bf16_run_in_bf16_where_the_cpu_has_it(mlm_dir, clf_dir):
    for precision in ("auto", "bf16"):
        options = EngineOptions(precision=precision)
        assert dtype(Encoder(mlm_dir, options).model) == torch.bfloat16
        assert dtype(MaskFiller(mlm_dir, options).model) == torch.bfloat16
        assert dtype(Predictor(clf_dir, options).task_model.model) == torch.bfloat16
    assert dtype(Predictor(clf_dir).task_model.model) == torch.float32  # the default: fp32


def test_int8_reaches_every_engine(mlm_dir, clf_dir):
    def int8_layers(model) -> int:
        return sum(isinstance(m, (Int8Linear, torch.ao.nn.quantized.dynamic.Linear)) for m in model.modules())

    int8 = EngineOptions(quantize="int8")
    assert int8_layers(Encoder(mlm_dir, int8).model) > 0
    assert int8_layers(MaskFiller(mlm_dir, int8).model) > 0
    assert int8_layers(Predictor(clf_dir, int8).task_model.model) > 0
    assert int8_layers(Predictor(clf_dir).task_model.model) == 0


def test_the_commands_hand_their_flags_to_the_engine(mlm_dir, clf_dir, monkeypatch, capsys):
    seen = []

    def recording(engine):
        class Recording(engine):
            def __init__(self, path, options=None, **kwargs):
                seen.append(options)
                super().__init__(path, options, **kwargs)
        return Recording

    for name in ("Encoder", "MaskFiller", "Predictor"):
        monkeypatch.setattr(bertforge.infer, name, recording(getattr(bertforge.infer, name)))
    monkeypatch.setattr(bertforge.infer.engines, "Predictor", bertforge.infer.Predictor)  # predict_records' own
    int8 = ["--quantize", "int8", "--device", "cpu"]
    assert main(["embed", "--model", str(mlm_dir), "--text", "good", *int8]) == 0
    assert main(["fill-mask", "--model", str(mlm_dir), "a [MASK] film", *int8]) == 0
    assert main(["predict", "--model", str(clf_dir), "--text", "good", *int8]) == 0
    assert seen == [EngineOptions(device="cpu", quantize="int8")] * 3
    capsys.readouterr()
