"""The training commands' CPU allocator setting (bertforge.train.memory), checked in a fresh process: it is
process-wide."""

import ctypes.util
import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                                 reason="the setting is for glibc on Linux"),
              pytest.mark.slow]  # a Python process that imports torch

# One fresh process (the setting is process-wide and cannot be undone, so the order matters) reports, as JSON lines:
# the heap's mmapped blocks (glibc's mallinfo2().hblks) while a 64 MB tensor is alive, left alone, then opted out,
# then applied; then whether each command applies it (the module forgets between commands that it applied it).
SCRIPT = textwrap.dedent("""
    import ctypes, ctypes.util, json, os, sys
    import torch
    from bertforge import cli
    from bertforge.train import memory

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks "
                                                     "uordblks fordblks keepcost").split()]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = Info

    def mapped_blocks(apply):
        applied = memory.keep_freed_memory() if apply else False
        before = libc.mallinfo2().hblks
        t = torch.ones(16 << 20)  # 64 MB, above glibc's largest mmap threshold
        during = libc.mallinfo2().hblks
        return [applied, during - before, memory.keep_freed_memory() == applied if apply else None]

    print(json.dumps({"plain": mapped_blocks(False)}))
    os.environ["BERTFORGE_SYSTEM_MALLOC"] = "1"
    print(json.dumps({"opted_out": mapped_blocks(True)}))
    del os.environ["BERTFORGE_SYSTEM_MALLOC"]
    memory._applied = None
    print(json.dumps({"applied": mapped_blocks(True)}))  # and applying again changes nothing
    commands = []
    for argv in json.loads(sys.argv[1]):
        memory._applied = None
        cli.main(argv)
        commands.append(memory._applied)
    print(json.dumps({"commands": commands}))
""")
COMMANDS = [
    ["model", "info", "--model", "mini"],  # runs no model over data: left alone
    # a training command applies it before it starts, here before refusing a missing data directory
    ["finetune", "--task", "csv", "--data", "/nonexistent", "--init", "/nonexistent", "--out", "/nonexistent/out"],
    # so does a command that runs a model over a file of texts (its batches' activations are as big)
    ["predict", "--model", "/nonexistent", "--input", "/nonexistent.jsonl"],
]


@pytest.fixture(scope="module")
def reported() -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(COMMANDS)], capture_output=True, text=True,
                         check=True)
    return {k: v for line in out.stdout.splitlines() if line.startswith("{") for k, v in json.loads(line).items()}


def test_large_tensors_come_from_the_reusable_heap(reported):
    assert reported["plain"] == [False, 1, None]  # by default glibc maps a fresh block for it
    assert reported["applied"] == [True, 0, True]  # applied (and applying again changes nothing)


def test_the_setting_can_be_turned_off(reported):
    assert reported["opted_out"] == [False, 1, True]


def test_the_cli_applies_it_before_training_and_batch_inference_only(reported):
    assert reported["commands"] == [None, True, True]
