"""torchrun / DDP setup in one place. Model and data code stay single-device.

Under `torchrun --nproc-per-node N`, RANK, WORLD_SIZE and LOCAL_RANK are set; gloo is used on CPU and NCCL
on CUDA. Only rank 0 writes files and logs.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def pick_device(requested: str | None = None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


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


def all_reduce_sum(values: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_flag(flag: bool, d: Dist) -> bool:
    """True on every rank if it is True on any rank (used to stop all ranks together)."""
    if not d.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()
