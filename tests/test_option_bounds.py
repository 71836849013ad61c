"""Every numeric option refuses nan, the infinities, a magnitude past its cap and a negative value where none makes
sense (issue #64): through `bertforge.cli.main`, one `error:` line naming the flag and exit status 2, before the
command does any work; in a `--config` file too. The commands and their options are found from the CLI's commands
and their argument classes, not listed here, so a new option is covered as it is declared."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import typing
from dataclasses import MISSING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bertforge.options
from bertforge.bounds import Bound
from bertforge.cli import _commands, build_parser, main
from bertforge.commands.arguments import _unwrap_optional, flag_name
from bertforge.options import cli_name, default_of


@dataclasses.dataclass(frozen=True)
class Numeric:
    """One numeric option of one command."""

    command: str
    name: str  # the field's, as in a --config file
    tp: type  # int or float (of each value, for a list)
    listed: bool  # takes a list of numbers (--betas)
    bound: Bound | None
    default: typing.Any

    @property
    def flag(self) -> str:
        return flag_name(self.name)


def numeric_fields(cls: type) -> list[tuple[dataclasses.Field, type, bool]]:
    """The fields of `cls` declared with `option` whose values are numbers: (field, int or float, listed)."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        listed = typing.get_origin(tp) in (list, tuple)
        tp = typing.get_args(tp)[0] if listed else tp
        if "help" in f.metadata and tp in (int, float):
            found.append((f, tp, listed))
    return found


COMMANDS = {cmd.name: cmd for cmd in _commands()}
OPTIONS = [Numeric(name, f.name, tp, listed, f.metadata.get("bound"), default_of(f))
           for name, cmd in COMMANDS.items() for f, tp, listed in numeric_fields(cmd.args)]
# The option classes of bertforge.options (LoopOptions, FinetuneOptions, ...): every one of their numeric options.
OPTION_CLASSES = [v for v in vars(bertforge.options).values()
                  if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == "bertforge.options"]
LIBRARY_OPTIONS = [(cls, f) for cls in OPTION_CLASSES for f, _, _ in numeric_fields(cls)]


def required_argv(command: str) -> list[str]:
    """`command` with a value for each argument it requires: the first choice, or a path that does not exist
    (nothing is read: `test_the_required_arguments_alone_reach_the_command` shows they parse)."""
    cmd = COMMANDS[command]
    argv = command.split()
    for f in dataclasses.fields(cmd.args):
        if default_of(f) is not MISSING:
            continue
        value = (f.metadata.get("choices") or [f"no-such-{f.name}"])[0]
        argv += [value] if f.metadata.get("positional") else [flag_name(f.name), value]
    return argv


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """Exit status, standard output and standard error of `bertforge ARGV`, run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def refusal_problem(code: int, out: str, err: str, *needles: str) -> str | None:
    """What is wrong with a refusal (None: nothing): exit status 2, nothing on stdout, and on stderr one line,
    `error: ...`, holding each of `needles`."""
    if code != 2:
        return f"exit status {code}, not 2 ({err!r})"
    if out:
        return f"wrote {out!r} on stdout"
    lines = err.splitlines()
    if len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in err:
        return f"not one error: line: {err!r}"
    missing = [n for n in needles if n not in lines[0]]
    return f"{lines[0]!r} does not name {missing}" if missing else None


@pytest.fixture
def ran(monkeypatch) -> list:
    """The arguments of each command that got past parsing: every command records them instead of running."""
    calls: list = []
    commands = [dataclasses.replace(cmd, run=calls.append, keeps_freed_memory=False) for cmd in _commands()]
    monkeypatch.setattr("bertforge.cli._commands", lambda: commands)
    parser = build_parser()  # once for the test's many command lines (argparse keeps no state between them)
    monkeypatch.setattr("bertforge.cli.build_parser", lambda command=None: parser)
    return calls


NOT_FINITE = ["nan", "inf", "-inf", "1e400", "NaN", "-Infinity"]  # as typed; float() reads 1e400 as inf


def numbers_outside(option: Numeric) -> list[str]:
    """Finite numbers `option` must refuse, as typed (and as JSON writes them): past any cap (1e30), just past
    its cap, just below its bound, and negative ones where its bound starts at 0 or above."""
    b = option.bound
    if option.tp is int:
        return [str(10**30), str(b.hi + 1), str(b.lo - 1), *(["-1"] if b.lo >= 0 else [])]
    return ["1e30", repr(float(b.hi) if b.hi_open else math.nextafter(b.hi, math.inf)),
            repr(float(b.lo) if b.lo_open else math.nextafter(b.lo, -math.inf)), *(["-1", "-0.5"] if b.lo >= 0 else [])]


def test_every_numeric_option_has_both_ends_bounded():
    assert len(OPTIONS) > 70 and len(LIBRARY_OPTIONS) > 40  # the discovery found them (76 and 47 in May 2025)
    unbounded = [f"{o.command} {o.flag}" for o in OPTIONS
                 if o.bound is None or o.bound.lo is None or o.bound.hi is None or not math.isfinite(o.bound.hi)]
    unbounded += [f"{cls.__name__}.{f.name}" for cls, f in LIBRARY_OPTIONS
                  if f.metadata.get("bound") is None or f.metadata["bound"].hi is None]
    assert unbounded == []


def test_every_option_class_option_is_on_a_command_line_with_its_bound():
    """So that the command-line tests below cover every numeric option of bertforge.options."""
    on_cli = {(o.name, o.bound) for o in OPTIONS}
    missing = [f"{cls.__name__}.{f.name}" for cls, f in LIBRARY_OPTIONS
               if (cli_name(f), f.metadata.get("bound")) not in on_cli]
    assert missing == []


def test_every_declared_default_is_within_its_bound():
    def outside(bound: Bound, default) -> bool:
        values = default if isinstance(default, (list, tuple)) else [default]
        return any(not bound.admits(v) for v in values)

    wrong = [f"{o.command} {o.flag} {o.default}" for o in OPTIONS
             if o.default not in (MISSING, None) and outside(o.bound, o.default)]
    wrong += [f"{cls.__name__}.{f.name} {default_of(f)}" for cls, f in LIBRARY_OPTIONS
              if default_of(f) not in (MISSING, None) and outside(f.metadata["bound"], default_of(f))]
    assert wrong == []


def test_no_bound_admits_nan_or_an_infinity():
    for bound in [Bound(), Bound(lo=0), Bound(hi=1), Bound(lo=0, hi=1), Bound(lo=0, lo_open=True)]:
        assert not any(bound.admits(v) for v in (math.nan, math.inf, -math.inf)), bound
        assert bound.admits(0.5)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_required_arguments_alone_reach_the_command(command, ran):
    """The command lines below differ from one that parses only by the option under test."""
    code, _, err = run_cli(required_argv(command))
    assert code == 0 and len(ran) == 1, err


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: f"{o.command}{o.flag}")
def test_each_numeric_option_refuses_what_is_not_finite_or_out_of_range(option, ran):
    problems = []
    for text in [*NOT_FINITE, *numbers_outside(option)]:
        code, out, err = run_cli([*required_argv(option.command), f"{option.flag}={text}"])
        problem = refusal_problem(code, out, err, f"argument {option.flag}:")
        if problem:
            problems.append(f"{option.flag}={text}: {problem}")
    assert problems == [] and ran == []


def out_of_range(option: Numeric) -> st.SearchStrategy:
    """Numbers outside `option`'s bound, of any magnitude, as typed on a command line."""
    b = option.bound
    if option.tp is int:
        above = st.integers(min_value=b.hi + 1, max_value=10**40)
        below = st.integers(min_value=-(10**40), max_value=b.lo - (0 if b.lo_open else 1))
        return (above | below).map(str)
    finite = {"allow_nan": False, "allow_infinity": False}
    above = st.floats(min_value=b.hi, exclude_min=not b.hi_open, **finite)
    below = st.floats(max_value=b.lo, exclude_max=not b.lo_open, **finite)
    return (above | below).map(repr)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_magnitude_outside_a_bound_is_refused(data, ran):
    option = data.draw(st.sampled_from(OPTIONS), label="option")
    text = data.draw(out_of_range(option), label="value")
    code, out, err = run_cli([*required_argv(option.command), f"{option.flag}={text}"])
    assert refusal_problem(code, out, err, f"argument {option.flag}:") is None
    assert ran == []


# What a --config file may hold that is not a finite number: Python's json reads NaN and the infinities, 1e400 as
# Infinity, and an integer too large for a float as an int.
CONFIG_NOT_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", str(10**400)]


def takes_a_config_file(option: Numeric) -> bool:
    """Whether `option` may be given in its command's --config file (one that has it, and not for an argument
    the command line must give)."""
    return "config" in {f.name for f in dataclasses.fields(COMMANDS[option.command].args)} and \
        option.default is not MISSING


@pytest.mark.parametrize("option", [o for o in OPTIONS if takes_a_config_file(o)], ids=lambda o: f"{o.command}{o.flag}")
def test_a_config_file_is_checked_like_the_command_line(option, ran, tmp_path):
    config = tmp_path / "options.json"
    problems = []
    for literal in [*CONFIG_NOT_FINITE, *numbers_outside(option)]:
        config.write_text(json.dumps({option.name: "X"}).replace('"X"', f"[{literal}]" if option.listed else literal))
        code, out, err = run_cli([*required_argv(option.command), "--config", str(config)])
        problem = refusal_problem(code, out, err, option.flag, str(config))
        if problem:
            problems.append(f"{literal}: {problem}")
    assert problems == [] and ran == []


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400", "1e9", "1e30", "-5", "0", "600000", "9e9h", "infs"])
def test_a_time_budget_is_refused_before_anything_runs(text, tmp_path, monkeypatch):
    """--minutes is a duration (30, 90s, 1.5h), parsed as the run is planned: pretrain and demo refuse one that
    is not positive and finite, or over a year, before any data is read or directory made."""
    commands = [dataclasses.replace(cmd, keeps_freed_memory=False) for cmd in _commands()]
    monkeypatch.setattr("bertforge.cli._commands", lambda: commands)
    monkeypatch.setattr("bertforge.pretrain.run.pretrain", lambda config: pytest.fail("pretrain ran"))
    monkeypatch.setattr("bertforge.demo.run.run_demo", lambda options: pytest.fail("the demo ran"))
    out = tmp_path / "run"
    code, stdout, err = run_cli(["pretrain", "--data", str(tmp_path / "no-data"), "--out", str(out),
                                 f"--minutes={text}"])
    assert refusal_problem(code, stdout, err, "--minutes") is None
    assert not out.exists()
    code, stdout, err = run_cli(["demo", "--out", str(out), f"--minutes={text}"])
    assert refusal_problem(code, stdout, err, "--minutes") is None
    assert not out.exists()
