"""The training commands' CPU allocator setting (bertforge.train.memory), checked in fresh processes: it is
process-wide."""

import ctypes.util
import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                                 reason="the setting is for glibc on Linux"),
              pytest.mark.slow]  # each test starts Python processes that import torch

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
    # One fresh process runs the three commands; between them the module forgets that it applied the setting,
    # so each command shows whether it applies it (applying twice is harmless, checked above).
    script = textwrap.dedent("""
        import json, sys
        from bertforge import cli
        from bertforge.train import memory
        for argv in json.loads(sys.argv[1]):
            memory._applied = None
            cli.main(argv)
            print("applied:", memory._applied)
    """)
    commands = [
        ["model", "info", "--model", "mini"],  # runs no model over data: left alone
        # a training command applies it before it starts, here before refusing a missing data directory
        ["finetune", "--task", "csv", "--data", "/nonexistent", "--init", "/nonexistent", "--out", "/nonexistent/out"],
        # so does a command that runs a model over a file of texts (its batches' activations are as big)
        ["predict", "--model", "/nonexistent", "--input", "/nonexistent.jsonl"],
    ]
    out = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], capture_output=True, text=True,
                         check=True)
    assert [line for line in out.stdout.splitlines() if line.startswith("applied:")] == [
        "applied: None", "applied: True", "applied: True"]
