"""Impossible flags and `--config` values end at parse time in one `error:` line with exit status 2, for every
numeric option of every command; `pretrain` refuses a run directory that holds something else without
--resume, and one that another process is using."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bertforge.cpu
from bertforge.cli import _commands, build_parser, main
from bertforge.commands.arguments import _unwrap_optional, build_args
from bertforge.train.rundir import LOCK_FILE, claim_run_dir

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)

# The required arguments of each command, so that only the option under test is wrong.
REQUIRED = {
    "model info": [],
    "model smoke": [],
    "vocab train": ["--corpus", "c.txt", "--out", "tok"],
    "prepare": ["--corpus", "c.txt", "--tokenizer", "tok", "--out", "data"],
    "inspect": ["data"],
    "pretrain": ["--data", "data", "--out", "run"],
    "finetune": ["--task", "sst2", "--data", "glue", "--init", "model", "--out", "ft"],
    "distill": ["--teacher", "ft", "--student", "tiny", "--task", "sst2", "--data", "glue", "--out", "small"],
    "evaluate": ["--model", "ft", "--data", "glue"],
    "predict": ["--model", "ft", "--text", "a text"],
    "fill-mask": ["--model", "model", "a [MASK]"],
    "embed": ["--model", "model", "--text", "a text"],
    "export": ["--model", "model", "--out", "m.onnx"],
    "demo": [],
    "serve": ["--model", "model"],
    "join": ["part1", "--out", "data"],
}

SEED = "[0,4294967295]"
BATCH = "[1,1048576]"  # 2**20
SEQ_LEN = "[8,65536]"  # 2**16
STEPS, STEP_INTERVAL = "[1,1e9]", "[0,1e9]"
MINUTES = "[0,527040]"  # a year
VOCAB = "[6,4194304]"  # 2**22
# Every numeric option and the values it takes, written out here rather than read from the declarations:
# "[a,b]", "(a,b)" and the like ranges, each with an upper end (issue 64). A numeric option missing here fails a test.
ALLOWED = {
    ("model smoke", "--steps"): STEPS,
    ("vocab train", "--vocab-size"): VOCAB, ("vocab train", "--min-frequency"): "[1,1e12]",
    ("vocab train", "--limit-alphabet"): "[1,1114112]",
    ("prepare", "--max-seq-len"): SEQ_LEN, ("prepare", "--workers"): "[1,1024]", ("prepare", "--val-fraction"): "[0,1)",
    ("prepare", "--seed"): SEED,
    ("inspect", "--num"): "[1,1e6]", ("inspect", "--max-seq-len"): SEQ_LEN, ("inspect", "--seed"): SEED,
    ("inspect", "--epoch"): "[0,1e9]",
    ("pretrain", "--steps"): STEPS, ("pretrain", "--batch-size"): BATCH, ("pretrain", "--micro-batch-size"): BATCH,
    ("pretrain", "--lr"): "(0,10]", ("pretrain", "--warmup-steps"): STEP_INTERVAL, ("pretrain", "--betas"): "[0,1)",
    ("pretrain", "--weight-decay"): "[0,100]", ("pretrain", "--mask-prob"): "(0,1)", ("pretrain", "--dropout"): "[0,1)",
    ("pretrain", "--max-seq-len"): SEQ_LEN, ("pretrain", "--max-predictions-per-seq"): "[1,65536]",
    ("pretrain", "--short-seq-prob"): "[0,1]", ("pretrain", "--dupe-factor"): "[1,1000]",
    ("pretrain", "--eval-every"): STEP_INTERVAL, ("pretrain", "--eval-batches"): "[0,1e6]",
    ("pretrain", "--save-every"): STEP_INTERVAL, ("pretrain", "--save-minutes"): MINUTES,
    ("pretrain", "--keep-last"): "[1,1e6]", ("pretrain", "--log-every"): STEPS, ("pretrain", "--seed"): SEED,
    ("pretrain", "--workers"): "[0,1024]", ("pretrain", "--clip-grad-norm"): "[0,1e6]",
    ("pretrain", "--stack-fraction"): "[0,1)", ("pretrain", "--stack-length-fraction"): "(0,1]",
    ("pretrain", "--stack-mask-prob"): "(0,1)",
    ("pretrain", "--bow-weight"): "[0,1e4]", ("pretrain", "--generator-width"): "(0,1]",
    ("pretrain", "--mlm-candidates"): "[0,4194304]",
    ("pretrain", "--generator-layers"): "(0,1]", ("pretrain", "--discriminator-weight"): "(0,1e4]",
    ("finetune", "--lr"): "(0,10]", ("finetune", "--batch-size"): BATCH, ("finetune", "--epochs"): "(0,1e4]",
    ("finetune", "--warmup-ratio"): "[0,1)", ("finetune", "--weight-decay"): "[0,100]", ("finetune", "--seed"): SEED,
    ("finetune", "--max-length"): "[5,65536]", ("finetune", "--micro-batch-size"): BATCH,
    ("finetune", "--seeds"): "[1,1000]", ("finetune", "--jobs"): "[1,64]",
    ("finetune", "--max-train-examples"): "[1,1e12]",
    ("finetune", "--eval-batch-size"): BATCH, ("finetune", "--layer-lr-decay"): "(0,1]",
    ("finetune", "--reinit-layers"): "[0,1000]", ("finetune", "--save-every"): STEPS,
    ("finetune", "--save-minutes"): MINUTES, ("finetune", "--keep-last"): "[1,1e6]", ("finetune", "--minutes"): MINUTES,
    ("distill", "--lr"): "(0,10]", ("distill", "--batch-size"): BATCH, ("distill", "--epochs"): "(0,1e4]",
    ("distill", "--warmup-ratio"): "[0,1)", ("distill", "--weight-decay"): "[0,100]", ("distill", "--seed"): SEED,
    ("distill", "--max-length"): "[5,65536]", ("distill", "--micro-batch-size"): BATCH,
    ("distill", "--max-train-examples"): "[1,1e12]", ("distill", "--eval-batch-size"): BATCH,
    ("distill", "--layer-lr-decay"): "(0,1]", ("distill", "--reinit-layers"): "[0,1000]",
    ("distill", "--save-every"): STEPS, ("distill", "--save-minutes"): MINUTES, ("distill", "--keep-last"): "[1,1e6]",
    ("distill", "--minutes"): MINUTES,
    ("distill", "--temperature"): "(0,100]", ("distill", "--alpha"): "[0,1000]",
    ("distill", "--max-transfer-texts"): "[1,1e12]", ("distill", "--transfer-words"): "[1,100000]",
    ("distill", "--teacher-batch-size"): BATCH,
    ("finetune", "--windows"): "[1,1000]", ("distill", "--windows"): "[1,1000]", ("evaluate", "--windows"): "[1,1000]",
    ("predict", "--windows"): "[1,1000]",
    ("evaluate", "--batch-size"): BATCH, ("predict", "--batch-size"): BATCH, ("fill-mask", "--top-k"): "[1,4194304]",
    ("export", "--opset"): "[17,100]",
    ("demo", "--finetune-epochs"): "(0,1e4]", ("demo", "--finetune-seeds"): "[1,1000]", ("demo", "--jobs"): "[1,64]",
    ("demo", "--distill-seeds"): "[1,1000]", ("demo", "--transfer-texts"): "[1,1e12]",
    ("demo", "--finetune-lr-pretrained"): "(0,10]", ("demo", "--finetune-lr-scratch"): "(0,10]",
    ("demo", "--finetune-examples"): "[1,1e12]", ("demo", "--seed"): SEED, ("demo", "--vocab-size"): VOCAB,
    ("demo", "--batch-size"): BATCH,
    ("serve", "--port"): "[0,65535]", ("serve", "--max-batch-tokens"): "[1,16777216]",
    ("serve", "--max-wait-ms"): "[0,60000]", ("serve", "--max-queue"): "[1,16777216]",
    ("serve", "--max-inputs"): BATCH, ("serve", "--max-body-bytes"): "[64,2147483648]",
}


def allowed(spec: str, value: float) -> bool:
    if not math.isfinite(value):
        return False
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    return (value > lo if spec[0] == "(" else value >= lo) and (value < hi if spec[-1] == ")" else value <= hi)


def numeric_options() -> dict[tuple[str, str], tuple[type, bool]]:
    """(command, flag) -> (int or float, takes a list) for every numeric option the CLI has."""
    found = {}
    for cmd in _commands():
        hints = typing.get_type_hints(cmd.args)
        for f in dataclasses.fields(cmd.args):
            tp, _ = _unwrap_optional(hints[f.name])
            listed = typing.get_origin(tp) is list
            tp = typing.get_args(tp)[0] if listed else tp
            if tp in (int, float):
                found[(cmd.name, "--" + f.name.replace("_", "-"))] = (tp, listed)
    return found


OPTIONS = numeric_options()


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit status, standard output and standard error of `bertforge ARGV` run in this process."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def with_option(command: str, flag: str, text: str) -> list[str]:
    """The command line of `command` with `flag=text` (the `=` form, so that `-1e-3` is a value, not a flag)."""
    return [*command.split(), *REQUIRED[command], f"{flag}={text}"]


def test_every_numeric_option_has_its_range_declared():
    assert set(OPTIONS) == set(ALLOWED)


# The impossible values issue 21 reports, and more: zero, negative, out of range, not finite, not an integer.
IMPOSSIBLE = [("pretrain", "--batch-size", "0"), ("pretrain", "--log-every", "0"), ("pretrain", "--lr", "-1e-3"),
              ("pretrain", "--lr", "0"), ("pretrain", "--keep-last", "0"), ("pretrain", "--warmup-steps", "-5"),
              ("pretrain", "--max-seq-len", "0"), ("pretrain", "--mask-prob", "1"), ("pretrain", "--steps", "1.5"),
              ("pretrain", "--lr", "nan"), ("pretrain", "--dropout", "inf"), ("pretrain", "--seed", "-1"),
              ("finetune", "--max-length", "1"), ("finetune", "--epochs", "0"), ("finetune", "--lr", "0"),
              ("finetune", "--batch-size", "0"), ("finetune", "--warmup-ratio", "1"), ("finetune", "--seeds", "0"),
              ("model smoke", "--steps", "0"), ("vocab train", "--vocab-size", "3"), ("prepare", "--max-seq-len", "4"),
              ("prepare", "--val-fraction", "1"), ("prepare", "--workers", "0"), ("inspect", "--num", "0"),
              ("evaluate", "--batch-size", "0"), ("predict", "--batch-size", "-2"), ("fill-mask", "--top-k", "0"),
              ("export", "--opset", "13"), ("demo", "--finetune-seeds", "0"),
              ("pretrain", "--betas", "1"), ("pretrain", "--stack-fraction", "1"),
              ("pretrain", "--stack-length-fraction", "0"), ("pretrain", "--stack-length-fraction", "1.5"),
              ("pretrain", "--bow-weight", "-0.1"), ("pretrain", "--generator-width", "0"),
              ("pretrain", "--generator-layers", "1.5"), ("pretrain", "--discriminator-weight", "0"),
              ("pretrain", "--mlm-candidates", "-1"), ("finetune", "--layer-lr-decay", "0"),
              ("finetune", "--layer-lr-decay", "1.2"), ("finetune", "--reinit-layers", "-1"),
              ("pretrain", "--steps", "1000000001"), ("pretrain", "--lr", "11"), ("pretrain", "--lr", "1e400"),
              ("finetune", "--epochs", "1e30"), ("serve", "--max-wait-ms", "-inf"), ("serve", "--port", "65536")]


@pytest.fixture
def nothing_runs(monkeypatch):
    """The real parser and error path, but a command that gets past parsing fails the test instead of running."""
    def fail(args):
        pytest.fail(f"ran with {args}")

    commands = [dataclasses.replace(cmd, run=fail) for cmd in _commands()]
    monkeypatch.setattr("bertforge.cli._commands", lambda: commands)


@pytest.mark.parametrize(("command", "flag", "text"), IMPOSSIBLE)
def test_an_impossible_value_is_one_error_line(command, flag, text, capsys, nothing_runs):
    code, out, err = cli(with_option(command, flag, text), capsys)
    assert_one_error_line(code, err, f"argument {flag}", f"bertforge {command} --help")
    assert out == ""


@pytest.mark.parametrize("text", ["0", "-5", "soon", "10x"])
def test_the_demo_refuses_a_budget_that_is_not_minutes_or_auto_before_fetching_anything(text, capsys, monkeypatch):
    monkeypatch.setattr("bertforge.demo.run.run_demo", lambda options: pytest.fail("the demo ran"))
    code, out, err = cli(["demo", f"--minutes={text}"], capsys)
    assert_one_error_line(code, err, "--minutes", text)
    assert out == ""


@pytest.mark.slow  # every numeric option of every command, twice
def test_every_command_refuses_each_numeric_option_below_and_above_its_range(capsys, nothing_runs):
    for (command, flag), spec in ALLOWED.items():
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        tp = OPTIONS[(command, flag)][0]
        for outside in (lo - 1, hi + 1 if tp is int else hi * 1.5):
            code, _, err = cli(with_option(command, flag, str(tp(outside))), capsys)
            assert_one_error_line(code, err, f"argument {flag}")


whole_parser = functools.cache(build_parser)  # built once for the many examples: argparse keeps no state between them


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(option=st.sampled_from(sorted(ALLOWED)), data=st.data())
def test_the_parser_accepts_exactly_the_allowed_values(option, data):
    command, flag = option
    tp, _ = OPTIONS[option]
    spec = ALLOWED[option]
    if tp is int:
        value = data.draw(st.integers(-10, 40) | st.integers(-2**40, 2**40) | st.just(2**32) | st.just(2**32 - 1))
    else:
        value = data.draw(st.floats(-2.0, 2.0) | st.floats() | st.sampled_from([0.0, 1.0, -0.0, 1e-12, 1 - 1e-12]))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            ns = whole_parser().parse_args(with_option(command, flag, repr(value)))
        except SystemExit as e:
            assert e.code == 2
            assert not allowed(spec, value), f"{command} {flag} {value!r} was refused: {stderr.getvalue()}"
            assert stderr.getvalue().startswith(f"error: argument {flag}") and stderr.getvalue().count("\n") == 1
            return
    assert allowed(spec, value), f"{command} {flag} {value!r} was accepted"
    got = getattr(ns, flag[2:].replace("-", "_"))
    assert got == ([value] if OPTIONS[option][1] else value)


def test_main_returns_2_for_a_bad_command_line_and_exits_0_for_help(capsys):
    assert main(["pretrain", "--data", "d", "--out", "o", "--keep-last", "0"]) == 2
    assert_one_error_line(2, capsys.readouterr().err, "argument --keep-last: must be in [1, 1_000_000], not 0")
    with pytest.raises(SystemExit) as e:
        main(["pretrain", "--help"])
    assert e.value.code == 0 and "in [1, 1_000_000]" in capsys.readouterr().out


def test_a_wrong_type_or_missing_argument_is_one_error_line(capsys):
    code, _, err = cli(["pretrain", "--data", "d", "--out", "o", "--steps", "ten"], capsys)
    assert_one_error_line(code, err, "--steps", "expected an integer, not 'ten'")
    code, _, err = cli(["pretrain", "--data", "d"], capsys)
    assert_one_error_line(code, err, "required", "--out")
    code, _, err = cli(["pretrain", "--data", "d", "--out", "o", "--optimizer", "sgd"], capsys)
    assert_one_error_line(code, err, "--optimizer", "invalid choice")


@pytest.mark.parametrize("argv", [
    ["pretrain", "--data", "d", "--out", "o", "--log-every", "0"],
    ["finetune", "--task", "sst2", "--data", "d", "--init", "m", "--out", "o", "--max-length", "1"],
])
def test_the_installed_command_ends_in_one_error_line(argv):
    r = subprocess.run([sys.executable, "-m", "bertforge", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: argument "), r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("argv", [["embed", "--model", "no-model", "--text", "a"],
                                  ["predict", "--model", "no-model", "--text", "a"],
                                  ["evaluate", "--model", "no-model", "--data", "no-data"]])
def test_a_directory_as_output_file_is_refused_before_the_model_loads(argv, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.mkdir()
    code, _, err = cli([*argv, "--out", str(out)], capsys)
    assert_one_error_line(code, err, f"--out {out} is a directory")


# -- --config ---------------------------------------------------------------------------------------------------

def pretrain_args(config: Path, *given: str):
    """`bertforge pretrain`'s arguments with the `--config` file `config` and the flags `given`, resolved as the
    command does."""
    ns = build_parser().parse_args(["pretrain", "--data", "d", "--out", "o", "--config", str(config), *given])
    return build_args(ns._command.args, ns)


@pytest.mark.parametrize(("values", "needles"), [
    ({"batch_size": "32"}, ["--batch-size", "must be an integer", '"32"']),
    ({"lr": "1e-3"}, ["--lr", "must be a number"]),
    ({"steps": True}, ["--steps", "must be an integer, not true"]),
    ({"keep_last": 0}, ["--keep-last", "in [1, 1_000_000], not 0"]),
    ({"steps": 10**9 + 1}, ["--steps", "in [1, 1_000_000_000], not 1000000001"]),
    ({"lr": float("inf")}, ["--lr", "finite", "Infinity"]),
    ({"mask_prob": 1.5}, ["--mask-prob", "in (0, 1), not 1.5"]),
    ({"lr": float("nan")}, ["--lr", "finite"]),
    ({"betas": [0.9, 1.0]}, ["--betas", "in [0, 1), not 1.0"]),
    ({"betas": 0.9}, ["--betas", "must be a list"]),
    ({"optimizer": "sgd"}, ["--optimizer", "one of adamw, lamb"]),
    ({"log_every": None}, ["--log-every", "must not be null"]),
    ({"out": "elsewhere"}, ["--out", "command line only"]),
    ({"batch_sise": 32}, ["unknown options", "batch_sise"]),
])
def test_config_values_are_checked_like_the_command_line(tmp_path, values, needles):
    from bertforge.errors import BertforgeError

    config = tmp_path / "run.json"
    config.write_text(json.dumps(values))
    with pytest.raises(BertforgeError) as e:
        pretrain_args(config)
    message = str(e.value)
    assert "\n" not in message and str(config) in message
    for needle in needles:
        assert needle in message, message


def test_a_bad_config_file_ends_pretrain_in_one_error_line(tmp_path, capsys):
    config = tmp_path / "run.json"
    config.write_text('{"batch_size": "thirty-two"}')
    code, _, err = cli(["pretrain", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                        "--config", str(config)], capsys)
    assert_one_error_line(code, err, "--batch-size", str(config))
    assert not (tmp_path / "o").exists()


def test_good_config_values_apply_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"lr": 5e-4, "steps": 200, "betas": [0.9, 0.98], "nsp": False, "minutes": "90s"}))
    args = pretrain_args(config, "--steps", "50")
    assert (args.lr, args.steps, args.betas, args.nsp, args.minutes) == (5e-4, 50, [0.9, 0.98], False, "90s")
    assert isinstance(args.lr, float)


# -- run directories ----------------------------------------------------------------------------------------------

def test_pretrain_refuses_a_non_empty_out_without_resume(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = cli(["pretrain", "--data", str(tmp_path / "no-data"), "--out", str(out)], capsys)
    assert_one_error_line(code, err, f"--out {out} is not empty (notes.txt)", "--resume", "new directory")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # left exactly as it was
    assert (out / "notes.txt").read_text() == "mine"


def test_pretrain_refuses_a_file_as_out(tmp_path, capsys):
    out = tmp_path / "run"
    out.write_text("not a directory")
    code, _, err = cli(["pretrain", "--data", str(tmp_path / "no-data"), "--out", str(out)], capsys)
    assert_one_error_line(code, err, f"--out {out} is a file")
    assert out.read_text() == "not a directory"


def test_stale_temporaries_do_not_count_and_are_removed(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".metrics.jsonl.x1y2.tmp").write_text("half")
    with claim_run_dir(out, resume=False):
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    (out / "checkpoints" / ".step-4.abc123.tmp").mkdir(parents=True)
    (out / "checkpoints" / "step-2").mkdir()
    with claim_run_dir(out, resume=True):
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]


def test_a_directory_never_used_leaves_no_trace_when_the_run_fails_to_start(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    code, _, err = cli(["pretrain", "--data", str(tmp_path / "no-data"), "--out", str(out)], capsys)
    assert_one_error_line(code, err, "no-data")
    assert not out.exists()


def test_bf16_training_on_a_cpu_without_bf16_is_refused_before_the_directory_is_made(tmp_path, capsys, monkeypatch):
    """Emulated bf16 trains many times slower than fp32 (10.3 s against 0.45 s for a BERT-mini step on an
    AVX2-only CPU): an explicit --precision bf16 there is one error line, as it is for inference."""
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: False)
    out = tmp_path / "new" / "run"
    code, _, err = cli(["pretrain", "--data", str(tmp_path / "no-data"), "--out", str(out), "--precision", "bf16"],
                       capsys)
    assert_one_error_line(code, err, "--precision bf16: this CPU has no bf16 dot products", "--precision fp32")
    assert not out.exists()


HOLD = ("import sys, time\nfrom bertforge.train.rundir import claim_run_dir\n"
        "claim_run_dir(sys.argv[1], resume=False)\nprint('held', flush=True)\ntime.sleep(300)\n")


@pytest.mark.slow  # starts and kills a process
def test_a_second_process_is_refused_at_once_and_a_killed_holder_frees_the_directory(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for extra in ([], ["--resume"]):
            code, _, err = cli(["pretrain", "--data", str(tmp_path / "no-data"), "--out", str(out), *extra], capsys)
            assert_one_error_line(code, err, f"--out {out} is in use by another bertforge process",
                                  f"pid {holder.pid}")
    finally:
        holder.kill()  # SIGKILL: no clean-up code runs, the kernel drops the lock
        holder.wait()
    with claim_run_dir(out, resume=True), pytest.raises(Exception, match="in use"):  # within one process too
        claim_run_dir(out, resume=True)


@pytest.mark.slow  # three pretraining runs
def test_a_run_is_refused_without_resume_and_continues_with_it(prepared, tiny_config_file, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["pretrain", "--data", str(prepared), "--out", str(out), "--model", tiny_config_file(num_hidden_layers=1),
            "--steps", "4", "--batch-size", "4", "--warmup-steps", "1", "--save-every", "2", "--log-every", "1",
            "--eval-batches", "0", "--no-progress"]
    code, out_text, err = cli(argv, capsys)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    code, _, err = cli(argv, capsys)
    assert_one_error_line(code, err, "is not empty", "--resume")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    shutil.rmtree(out / "checkpoints" / "step-4")  # as if killed after step 3
    code, out_text, err = cli([*argv, "--resume"], capsys)
    assert code == 0, err
    assert "resumed from" in out_text and "step-2" in out_text
    assert (out / "checkpoints" / "step-4").is_dir()
    with claim_run_dir(out, resume=True):  # the finished runs let go of the directory
        pass
