"""The bench scripts call the library as it is now: every call in bench/*.py of a name imported from bertforge binds
to that callable's signature (positional count and keyword names). The benches run for minutes on real data, so the
suite does not run them; without this, an API change leaves a bench failing until someone runs it (bench/inference.py
called `finetune` with its old keywords for a week after the configuration object replaced them)."""

from __future__ import annotations

import ast
import importlib
import inspect
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _imported_names(tree: ast.AST) -> dict[str, tuple[str, str | None]]:
    """Local name -> (bertforge module, attribute or None for the module itself), from imports anywhere in the file."""
    names: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bertforge":
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "bertforge" and alias.asname:
                    names[alias.asname] = (alias.name, None)
    return names


def _resolve(module: str, attr: str | None):
    base = importlib.import_module(module)
    if attr is None:
        return base
    try:
        return getattr(base, attr)
    except AttributeError:
        return importlib.import_module(f"{module}.{attr}")  # `from bertforge import kernels`: a submodule


def _callee(call: ast.Call, names: dict) -> tuple[str, object] | None:
    func = call.func
    if isinstance(func, ast.Name) and func.id in names:
        return func.id, _resolve(*names[func.id])
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names:
        owner = _resolve(*names[func.value.id])
        if isinstance(owner, types.ModuleType) and hasattr(owner, func.attr):
            return f"{func.value.id}.{func.attr}", getattr(owner, func.attr)
    return None


def _mismatches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = _imported_names(tree)
    found = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        callee = _callee(call, names)
        if callee is None or not callable(callee[1]):
            continue
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue  # *args or **kwargs: what binds is only known when it runs
        try:
            signature = inspect.signature(callee[1])
        except (TypeError, ValueError):
            continue  # a builtin without a signature
        try:
            signature.bind(*call.args, **{k.arg: k.value for k in call.keywords})
        except TypeError as error:
            found.append(f"{path.name}:{call.lineno} {callee[0]}(...): {error}")
    return found


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_every_call_into_bertforge_binds_to_its_signature(script):
    assert not _mismatches(script)


def test_a_call_with_old_keywords_is_caught(tmp_path):
    script = tmp_path / "old.py"
    script.write_text("from bertforge.finetune.run import finetune\n\n"
                      "def run(data, init, out, opts):\n"
                      "    return finetune('csv', data, init, out, options=opts)\n")
    [found] = _mismatches(script)
    assert found.startswith("old.py:4 finetune(...)")
