"""The layering contract (docs/design.md "Layering", docs/architecture.md), checked over the import graph of
src/bertforge: the command line sits on top of the library and is never imported back; inference never imports
training; no module imports itself through others; and the size limits of the style guide.

The graph is read from the source with `ast`, so it holds every import a module can run: top-level ones, those
inside functions (deferred imports still make a dependency) and those under `if TYPE_CHECKING:` (a type-only
import still points the other way). Relative imports are resolved against the importing module's package, and an
import of a package is an edge to its `__init__`.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "bertforge"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file; a package's name maps to its __init__.py."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported dotted name runs: itself, or the nearest enclosing module (`pkg.mod.Class` ->
    `pkg.mod`); None for a name outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` (the module in `path`) imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(_target(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import mod` runs pkg (its __init__) and then the module pkg.mod
            found.add(_target(base, modules))
            found.update(_target(f"{base}.{alias.name}", modules) for alias in node.names)
    found.discard(None)
    found.discard(name)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles as paths that end where they start (`[a, b, a]`): in each strongly connected group of modules,
    the shortest through its first module, then through each module no cycle so far passed; [] for none."""
    cycles = []
    for group in _strongly_connected(graph):
        if len(group) == 1 and not group & graph.get(min(group), set()):
            continue
        passed: set[str] = set()
        for start in sorted(group):
            if start not in passed:
                cycles.append(_shortest_cycle(graph, start, group))
                passed.update(cycles[-1])
    return sorted(cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> Iterator[set[str]]:
    """Tarjan's algorithm, iterative (an import chain may be deeper than the recursion limit cares for)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    yield group


def _shortest_cycle(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """Breadth-first from `start` inside its group back to `start`."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt in group and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in a cycle group but no cycle returns to it")


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def edges_breaking(graph: dict[str, set[str]], importer_in: str, imported_in: str,
                   allowed: tuple[str, ...] = ()) -> list[str]:
    """'a -> b' for every edge from a module in `importer_in` to one in `imported_in`, unless the importer is
    in one of `allowed`."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if _within(a, importer_in) and _within(b, imported_in)
                  and not any(_within(a, ok) for ok in allowed))


def long_files(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package).as_posix()
        if path.suffix in (".py", ".cpp", ".h"):
            lines = len(path.read_text().splitlines())
            if lines > MAX_FILE_LINES:
                found.append(f"{rel}: {lines} lines")
    return found


def long_functions(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(package).as_posix()}:{node.lineno} {node.name}: {lines} lines")
    return found


# --- the contract --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_only_the_command_line_imports_the_commands(graph):
    wrong = edges_breaking(graph, "bertforge", "bertforge.commands", allowed=("bertforge.commands", "bertforge.cli"))
    assert not wrong, "the library imports the command line:\n" + "\n".join(wrong)


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` imports directly or through others -> one import path from `start` to it."""
    paths, todo = {start: [start]}, [start]
    while todo:
        here = todo.pop()
        for there in sorted(graph.get(here, ())):
            if there not in paths:
                paths[there] = [*paths[here], there]
                todo.append(there)
    return paths


TRAINING = ("bertforge.train", "bertforge.pretrain", "bertforge.finetune", "bertforge.distill", "bertforge.demo")


@pytest.mark.parametrize("package", ["bertforge.infer", "bertforge.serve"])
def test_inference_and_serving_never_import_training(graph, package):
    """Not even through another module: loading a model to answer requests must not load the trainer."""
    wrong = sorted(" -> ".join(path) for start in graph if _within(start, package)
                   for name, path in reachable(graph, start).items()
                   if any(_within(name, training) for training in TRAINING))
    assert not wrong, f"{package} reaches training:\n" + "\n".join(wrong[:10])


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_source_file_over_the_limit():
    found = long_files()
    assert not found, f"source files over {MAX_FILE_LINES} lines:\n" + "\n".join(found)


def test_no_function_over_the_limit():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


# --- the checker itself, on a package written here -----------------------------------------------------------


def test_the_graph_resolves_relative_deferred_and_package_imports(tmp_path):
    pkg = tmp_path / "bertforge"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nfrom .sub import thing\n")
    (pkg / "b.py").write_text("def f():\n    import bertforge.sub.c as c\n    return c\n")
    (pkg / "sub" / "__init__.py").write_text("from ..a import name\n")
    (pkg / "sub" / "c.py").write_text("from .. import b\nimport os\n")
    assert import_graph(pkg) == {"bertforge": set(), "bertforge.a": {"bertforge", "bertforge.b", "bertforge.sub"},
                                 "bertforge.b": {"bertforge.sub.c"}, "bertforge.sub": {"bertforge.a"},
                                 "bertforge.sub.c": {"bertforge", "bertforge.b"}}


def test_a_cycle_is_found_and_reported_as_a_path():
    fake = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "p.d"}, "p.d": set(), "p.e": {"p.e"}}
    assert find_cycles(fake) == [["p.a", "p.b", "p.c", "p.a"], ["p.e", "p.e"]]
    assert find_cycles({"p.a": {"p.b"}, "p.b": set()}) == []
    # two cycles meeting in one module: each is reported
    assert find_cycles({"p.a": {"p.b", "p.c"}, "p.b": {"p.a"}, "p.c": {"p.a"}}) == [["p.a", "p.b", "p.a"],
                                                                                  ["p.c", "p.a", "p.c"]]


def test_the_rules_name_the_edges_that_break_them():
    fake = {"bertforge.demo.run": {"bertforge.commands.train"}, "bertforge.cli": {"bertforge.commands"},
            "bertforge.commands.train": {"bertforge.pretrain.run"},
            "bertforge.infer.engines": {"bertforge.train.loop", "bertforge.encoder"}}
    assert edges_breaking(fake, "bertforge", "bertforge.commands", ("bertforge.commands", "bertforge.cli")) == [
        "bertforge.demo.run -> bertforge.commands.train"]
    assert edges_breaking(fake, "bertforge.infer", "bertforge.train") == [
        "bertforge.infer.engines -> bertforge.train.loop"]


def test_the_size_limits_count_lines_of_files_and_functions(tmp_path):
    pkg = tmp_path / "bertforge"
    (pkg / "kernels").mkdir(parents=True)
    body = [f"x = {i}" for i in range(MAX_FUNCTION_LINES - 1)]  # a def line and these: the limit
    (pkg / "ok.py").write_text("def fits():\n" + "".join(f"    {line}\n" for line in body))
    (pkg / "long.py").write_text("class K:\n    def over(self):\n" + "".join(f"        {line}\n" for line in body)
                                 + "        return x\n")
    (pkg / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    (pkg / "kernels" / "vec.h").write_text("int x;\n" * (MAX_FILE_LINES + 1))
    (pkg / "kernels" / "ok.cpp").write_text("int x;\n" * MAX_FILE_LINES)
    assert long_files(pkg) == [f"big.py: {MAX_FILE_LINES + 1} lines", f"kernels/vec.h: {MAX_FILE_LINES + 1} lines"]
    assert long_functions(pkg) == [f"long.py:2 over: {MAX_FUNCTION_LINES + 1} lines"]
