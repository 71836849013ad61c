"""bertforge's own CPU kernels, for int8 inference and training's dropout and attention, built from `cpu_kernels.cpp`
on first use.

The int8 encoder layer spends its time between products in many small operators; `cpu_kernels.cpp` does a layer's
attention (scores, mask, softmax, weighted values; `attention.h`) in one pass per sequence and the residual add +
LayerNorm in one pass per row, each also giving the range of its output, which the next int8 product quantizes by.
On CPUs without int8 dot products the int8 products themselves run here too (`int8_u7.h`: 7-bit activations per
row, so that four products sum in int16), and on AVX-512 CPUs with VNNI (`int8_vnni.h`: 8-bit activations per
row, `vpdpbusd`; with AMX the small products only, oneDNN's AMX tiles taking the large). On CPUs without AVX-512,
fp32 inference's products of a few rows (a short text) run here too (`fp32_panels.h`). Training's dropout draws
its masks from a counter-based hash (`dropout.h`, for `bertforge.dropout`) in a small fraction of the time torch's
generator takes, and the backward of a Linear layer
on oneDNN (`bertforge.linear`) transposes its output's gradient here (`transpose.h`). fp32 training's attention runs
here forward and backward, dropout included, one head of a sequence at a time from and to the products' layouts
(`attention_train.h`, for `bertforge.training_attention`), and gradient clipping takes its norm of every
gradient here in one pass (`grad_norm.h`, for `bertforge.train.optim.clipped_step`), as AdamW its update of a task
model's word embedding, the rows never looked up only decayed (`adamw_rows.h`, for `bertforge.train.rows`). The
kernels are written once over
a small vector layer (`vec.h`) with two implementations, chosen when the file is compiled: AVX-512 (16 floats a
vector) and AVX2 + FMA (8); the u7 int8 products use AVX2's instructions in both builds, the VNNI ones exist only in
an AVX-512 build compiled on a CPU with avx512_vnni (`has_vnni`). At
run time the CPU's flags choose the build (`isa`): AVX-512 where the CPU has avx512f (`-march=native`), else AVX2
where it has avx2 and fma (`-mavx2 -mfma`), each built once with the C++ compiler torch's extensions use (`c++`,
with ninja), into its own directory of bertforge's cache; about 10 s. A finished build (its `.ready` marker beside
it) is then loaded directly, in about 1 ms and with no compiler or ninja, by every process of every environment
with the same torch. Where none can be loaded (neither ISA, no compiler where a build is needed, the build fails,
or `BERTFORGE_KERNELS=0`), `available()` is False: int8 inference runs on PyTorch's operators alone, with the same
results up to rounding, and dropout computes the same masks with them, slower.

`BERTFORGE_KERNELS`: unset or `1` the build the CPU's flags choose; `0` none (PyTorch's operators); `avx2` the AVX2
build even on an AVX-512 CPU (to test or measure what an AVX2-only CPU runs); `avx512` the AVX-512 build (none
where the CPU lacks avx512f).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

from bertforge import cpu
from bertforge.files import cache_dir

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")  # the one translation unit; it includes the headers beside it
# every file the build reads, hashed into its name
FILES = tuple(sorted(SOURCE.parent.glob("*.cpp")) + sorted(SOURCE.parent.glob("*.h")))
# Each build's compiler flags, in the order of preference. AVX-512 for this CPU (-march=native); AVX2 + FMA alone, so
# that the AVX2 build forced on an AVX-512 CPU is the one an AVX2-only CPU runs (-mtune only schedules). -fopenmp
# (compiling and linking) makes at::parallel_for share a kernel's rows over torch's threads (the same libgomp torch
# loaded): without it every kernel ran on the calling thread alone (attention over 64 x 40 tokens, 12 heads: 7.3 ms
# on two Zen 3 threads, 3.9 ms with it).
_FLAGS = {
    "avx512": ("-O3", "-march=native", "-fno-math-errno", "-fopenmp"),
    "avx2": ("-O3", "-mavx2", "-mfma", "-mtune=native", "-fno-math-errno", "-fopenmp"),
}
_NEEDS = {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}}  # the CPU flags each build runs on


def isa() -> str | None:
    """The build this process uses: `BERTFORGE_KERNELS`'s (avx2, avx512) where the CPU can run it, else the first
    of avx512 and avx2 the CPU's flags allow (unset, 1 or any other value); None for `BERTFORGE_KERNELS=0` or a CPU
    with neither."""
    asked = os.environ.get("BERTFORGE_KERNELS", "1")
    if asked == "0":
        return None
    runs = [name for name, needs in _NEEDS.items() if needs <= cpu.cpu_flags()]
    if asked in _FLAGS:
        return asked if asked in runs else None
    return runs[0] if runs else None


def _build_name(isa: str) -> str:
    """A name unique to the build (`isa`), the sources, the torch it runs on and the CPU's features, so that a cache
    shared between machines (a home directory on a cluster) never loads a build for another CPU or torch."""
    key = hashlib.sha256()
    for path in FILES:
        key.update(path.name.encode())
        key.update(path.read_bytes())
    # what decides whether torch can load the build (not where it is installed): two environments with the same
    # torch (a checkout's .venv and a fresh clone's) share one build, and as a finished build is loaded without
    # ninja (`_load_finished`), they no longer take turns rebuilding it, its ninja file naming the other's paths
    key.update(torch.__version__.encode())
    key.update(str(torch.version.git_version).encode())
    key.update(str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")).encode())
    key.update(" ".join(sorted(cpu.cpu_flags())).encode())
    key.update(" ".join(_FLAGS[isa]).encode())
    return f"bertforge_cpu_{isa}_{key.hexdigest()[:16]}"


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


def _load_finished(name: str, where: Path) -> bool:
    """Load the build in `where` if it is finished, as torch's `load()` would but without it: `load()` runs ninja
    to check the build is up to date, 0.2 s a process, where loading the library takes 1 ms and needs no compiler.
    Finished means its marker is there, written once a build succeeded: a linker writes the .so in place, so a
    .so alone may be another process's build under way. One that will not load (a corrupt file) is removed, with
    its marker, for the build to make it again."""
    marker, library = where / f"{name}.ready", where / f"{name}.so"
    if not marker.exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except Exception:
        marker.unlink(missing_ok=True)
        library.unlink(missing_ok=True)
        return False
    return True


def _mark_finished(name: str, where: Path) -> None:
    """The marker `_load_finished` asks for, written whole (a temporary file beside it, then renamed), so that a
    process never sees a part of one; where it cannot be written, later processes build (ninja) as before."""
    temporary = where / f"{name}.ready.{os.getpid()}"
    with contextlib.suppress(OSError):
        temporary.write_text("finished\n")
        os.replace(temporary, where / f"{name}.ready")


def _build(chosen: str, name: str, where: Path) -> bool:
    """Build (or find up to date, ninja says) and load `chosen` in `where`, then mark it finished; False, with one
    line on stderr, where a tool is missing or the build fails."""
    _put_pip_ninja_on_path()
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        needs = " and ".join(_INSTALL[tool] for tool in missing)
        _note(f"int8 and dropout run on PyTorch's operators alone here, slower: its CPU kernels need {needs} to be "
              "built")
        return False
    try:
        where.mkdir(parents=True, exist_ok=True)
        if not (where / f"{name}.so").exists():
            _note(f"building its CPU kernels ({chosen}) for this machine (once, about 10 s)")
        from torch.utils.cpp_extension import load

        load(name=name, sources=[str(SOURCE)], extra_cflags=list(_FLAGS[chosen]), extra_ldflags=["-fopenmp"],
             build_directory=str(where), is_python_module=False, verbose=False)
    except Exception as error:  # a failed build is slower, not a failed run
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        _note(f"int8 and dropout run on PyTorch's operators alone here, slower: its CPU kernels did not build "
              f"({first}); BERTFORGE_KERNELS=0 skips the attempt")
        return False
    _mark_finished(name, where)
    return True


@functools.cache
def available() -> bool:
    """Are the kernels loaded, the build `isa()` chooses (building it first if this machine has no such build yet)?
    False, with one line on stderr saying why and what to do, where they cannot be; quietly False for
    `BERTFORGE_KERNELS=0` and on a CPU with neither AVX-512 nor AVX2 + FMA."""
    asked = os.environ.get("BERTFORGE_KERNELS", "1")
    if asked not in ("0", "1", *_FLAGS):
        _note(f"BERTFORGE_KERNELS={asked} is not one of 0, 1, {', '.join(_FLAGS)}; taken as 1 (the CPU's best build)")
    chosen = isa()
    if chosen is None:
        if asked in _FLAGS:
            _note(f"int8 and dropout run on PyTorch's operators alone: BERTFORGE_KERNELS={asked} asks for kernels "
                  f"this CPU cannot run (it lacks {' and '.join(sorted(_NEEDS[asked] - cpu.cpu_flags()))})")
        return False  # PyTorch's operators serve other CPUs
    if _loaded():
        return True
    name = _build_name(chosen)
    where = cache_dir() / "kernels" / name
    return _load_finished(name, where) or _build(chosen, name, where)


def _trains(tensors: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...]) -> bool:
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or not torch.is_grad_enabled():
        return False
    return (any(t.requires_grad for t in tensors)
            and all(t.device.type == "cpu" and t.dtype in dtypes for t in tensors) and available())


def trains_fp32(*tensors: torch.Tensor) -> bool:
    """Whether fp32 CPU training through `tensors` runs on the kernels: not compiling or tracing (inductor and an
    exported graph take torch's operators), a gradient wanted of one of them, every one fp32 on the CPU, no autocast,
    and the kernels built. Evaluation and inference (no gradient) keep torch's operators and their bits."""
    return not torch.is_autocast_enabled("cpu") and _trains(tensors, (torch.float32,))


def trains_bf16_autocast(*tensors: torch.Tensor) -> bool:
    """As `trains_fp32`, but under bf16 autocast on the CPU, each tensor fp32 or bf16 (the products' outputs)."""
    return (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and _trains(tensors, (torch.float32, torch.bfloat16)))
