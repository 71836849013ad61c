"""bertforge's own CPU kernels for int8 inference, built from `cpu_int8.cpp` on first use.

The int8 encoder layer spends its time between products in many small operators; `cpu_int8.cpp` does a layer's
attention (scores, mask, softmax, weighted values) in one pass per sequence and the residual add + LayerNorm in
one pass per row, each also giving the range of its output, which the next int8 product quantizes by. They are
written for AVX512 and built once per machine with the C++ compiler torch's extensions use (`c++`, with
ninja), into bertforge's cache directory; about 10 s. Where that cannot happen (no AVX512, no compiler, the build
fails, or `BERTFORGE_KERNELS=0`), `available()` is False and int8 inference runs on PyTorch's operators alone,
with the same results up to rounding.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

from bertforge import cpu
from bertforge.files import cache_dir

SOURCE = Path(__file__).with_name("cpu_int8.cpp")
# the ISA the kernels are compiled for (-march=native): a build is only reused on a CPU with the same flags
_FLAGS = ("-O3", "-march=native", "-fno-math-errno")


def _build_name() -> str:
    """A name unique to the source, torch's version and the CPU's features, so that a cache shared between
    machines (a home directory on a cluster) never loads a build for another CPU."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(sorted(cpu.cpu_flags())).encode())
    key.update(" ".join(_FLAGS).encode())
    return f"bertforge_cpu_int8_{key.hexdigest()[:16]}"


_INSTALL = {"c++": "a C++ compiler (Debian/Ubuntu: apt install g++)", "ninja": "ninja (pip install ninja)"}


def _note(message: str) -> None:
    """One line on stderr, as the commands print their notes (stdout keeps the results)."""
    print(f"bertforge: {message}", file=sys.stderr, flush=True)


def _loaded() -> bool:
    """Are the kernels' operators registered in this process already?"""
    return hasattr(torch.ops, "bertforge") and hasattr(torch.ops.bertforge, "attention")


def _put_pip_ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; the ninja that pip installed with bertforge sits in the
    environment's bin directory, which is not on PATH when bertforge runs as .venv/bin/bertforge unactivated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    where = getattr(ninja, "BIN_DIR", None)
    if where and Path(where, "ninja").exists():
        os.environ["PATH"] = os.pathsep.join([where, os.environ.get("PATH", "")])


@functools.cache
def available() -> bool:
    """Are the kernels loaded (building them first if this machine has no build yet)? False, with one line on
    stderr saying why and what to install, where they cannot be; `BERTFORGE_KERNELS=0` turns them off quietly."""
    if os.environ.get("BERTFORGE_KERNELS", "1") == "0":
        return False
    if "avx512f" not in cpu.cpu_flags():
        return False  # written for AVX512; PyTorch's operators serve other CPUs
    if _loaded():
        return True
    _put_pip_ninja_on_path()
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        needs = " and ".join(_INSTALL[tool] for tool in missing)
        _note(f"int8 runs on PyTorch's operators alone here, slower: its CPU kernels need {needs} to be built")
        return False
    name = _build_name()
    where = cache_dir() / "kernels" / name
    try:
        where.mkdir(parents=True, exist_ok=True)
        if not (where / f"{name}.so").exists():
            _note("building its int8 CPU kernels for this machine (once, about 10 s)")
        from torch.utils.cpp_extension import load

        load(name=name, sources=[str(SOURCE)], extra_cflags=list(_FLAGS), build_directory=str(where),
             is_python_module=False, verbose=False)
    except Exception as error:  # a failed build is a slower int8, not a failed predict
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        _note(f"int8 runs on PyTorch's operators alone here, slower: its CPU kernels did not build ({first}); "
              "BERTFORGE_KERNELS=0 skips the attempt")
        return False
    return True
