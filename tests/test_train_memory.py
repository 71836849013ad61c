"""The training commands' CPU allocator setting (bertforge.train.memory), checked in fresh processes: it is
process-wide."""

import ctypes.util
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                                reason="the setting is for glibc on Linux")

# Counts the heap's mmapped blocks (glibc's mallinfo2().hblks) while a 64 MB tensor is alive.
SCRIPT = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    import torch
    from bertforge.train.memory import keep_freed_memory

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks "
                                                     "uordblks fordblks keepcost").split()]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = Info
    applied = keep_freed_memory() if sys.argv[1] == "apply" else False
    before = libc.mallinfo2().hblks
    t = torch.ones(16 << 20)  # 64 MB, above glibc's largest mmap threshold
    during = libc.mallinfo2().hblks
    print(applied, during - before, keep_freed_memory() == applied)
""")


def _run(mode: str, **env) -> list[str]:
    import os

    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return out.stdout.split()


def test_large_tensors_come_from_the_reusable_heap():
    assert _run("plain") == ["False", "1", "False"]  # by default glibc maps a fresh block for it
    assert _run("apply") == ["True", "0", "True"]  # applied (and applying again changes nothing)


def test_the_setting_can_be_turned_off():
    assert _run("apply", BERTFORGE_SYSTEM_MALLOC="1") == ["False", "1", "True"]


def test_the_cli_applies_it_before_training_and_batch_inference_only():
    script = textwrap.dedent("""
        import sys
        from bertforge import cli
        from bertforge.train import memory
        cli.main(sys.argv[1:])
        print(memory._applied)
    """)

    def applied(*argv: str) -> str:
        out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, check=True)
        return out.stdout.split()[-1]

    assert applied("model", "info", "--model", "mini") == "None"  # runs no model over data: left alone
    # a training command applies it before it starts, here before refusing a missing data directory
    assert applied("finetune", "--task", "csv", "--data", "/nonexistent", "--init", "/nonexistent",
                   "--out", "/nonexistent/out") == "True"
    # so does a command that runs a model over a file of texts (its batches' activations are as big)
    assert applied("predict", "--model", "/nonexistent", "--input", "/nonexistent.jsonl") == "True"
