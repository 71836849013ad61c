"""torchrun / DDP setup in one place. Model and data code stay single-device.

Under `torchrun --nproc-per-node N`, RANK, WORLD_SIZE and LOCAL_RANK are set; gloo is used on CPU and NCCL
on CUDA. Only rank 0 writes files and logs.

Every collective of bertforge is a function here, and none else calls torch.distributed: each builds its
tensors on `Dist.device`, the device the process group is declared for, so no caller can hand NCCL a CPU
tensor. tests/test_distributed.py runs two processes with every torch.distributed collective checked.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from bertforge.device import pick_device
from bertforge.errors import BertforgeError


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(device: str | None = None) -> Dist:
    """Initialise the process group when launched by torchrun; a no-op for a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(device=pick_device(device))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # objects in reference cycles that hold the group (a DDP wrapper) go first, not at exit
        dist.destroy_process_group()


def all_reduce_sum(values: Sequence[float], d: Dist) -> list[float]:
    """Element-wise sums of `values` over the processes, added in float64 on the group's device (NCCL refuses
    CPU tensors). Callers pass and get plain numbers, so no tensor of theirs decides where a collective runs."""
    if not d.enabled:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def any_rank(flag: bool, d: Dist) -> bool:
    """True on every rank if it is True on any rank (used to stop all ranks together)."""
    return any_ranks([flag], d)[0]


def main_decides(check: Callable[[], Any], d: Dist, elsewhere: str) -> Any:
    """Run `check` on the main process alone (claiming a directory, reading what it holds) and stop every rank if it
    raised a BertforgeError there: the main process raises it, the others an error saying `elsewhere` (where to look).
    Returns what `check` returned on the main process, None on the others."""
    refusal, result = None, None
    if d.is_main:
        try:
            result = check()
        except BertforgeError as e:
            refusal = e
    if any_rank(refusal is not None, d):
        raise refusal or BertforgeError(elsewhere)
    return result


def any_ranks(flags: Sequence[bool], d: Dist) -> list[bool]:
    """`any_rank` of several flags in one collective (the training loop asks two questions every step)."""
    if not d.enabled:
        return [bool(f) for f in flags]
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def gather_objects(obj: Any, d: Dist) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank. The process group stages the pickled
    bytes on its own device (under NCCL the current CUDA device, which `setup` sets)."""
    if not d.enabled:
        return [obj]
    gathered: list[Any] = [None] * d.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def shard(n: int, d: Dist) -> range:
    """This rank's share of n items for work split over the processes (evaluation): items rank, rank + W, ..."""
    return range(d.rank, n, d.world_size)


def unshard(parts: Sequence[Sequence[Any]], n: int) -> list[Any]:
    """The n items in their order again, from every rank's `shard` of them (`parts` in rank order)."""
    items: list[Any] = [None] * n
    for rank, part in enumerate(parts):
        items[rank::len(parts)] = part
    return items


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier(device_ids=[d.device.index] if d.device.type == "cuda" else None)
