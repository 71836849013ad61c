"""AdamW (or LAMB) with BERT's parameter groups, and warmup followed by linear decay."""

from __future__ import annotations

import inspect
import math
import re

import torch
from torch import nn

from bertforge import kernels
from bertforge.train import rows

NO_DECAY_SUFFIXES = ("bias", "LayerNorm.weight", "_norm.weight", "norm.weight")


def parameter_groups(model: nn.Module, weight_decay: float, *, lr: float | None = None,
                     layer_lr_decay: float = 1.0) -> list[dict]:
    """Weight decay on matrices and embeddings, none on biases and LayerNorm (as BERT did). With `layer_lr_decay`
    d < 1, layer-wise learning rates as ELECTRA fine-tunes: `lr` for the heads and pooler, lr x d for the top
    encoder layer, lr x d^2 for the one below, ..., lr x d^(L+1) for the embeddings: the lower a layer, the more
    general what pretraining taught it, and the less fine-tuning should move it."""
    scale = _layer_scales(model, layer_lr_decay) if layer_lr_decay != 1.0 else lambda name: 1.0
    groups: dict[tuple[bool, float], list] = {(True, 1.0): [], (False, 1.0): []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((not (name.endswith(NO_DECAY_SUFFIXES) or p.ndim == 1), scale(name)), []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decays else 0.0,
             **({"lr": lr * factor} if factor != 1.0 and lr is not None else {})}
            for (decays, factor), ps in groups.items()]


_LAYER = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")
_EMBEDDINGS = re.compile(r"(?:^|\.)embeddings\.")


def _layer_scales(model: nn.Module, decay: float):
    """name -> decay^(L + 1 - depth): depth 0 for the embeddings, i + 1 for encoder layer i, L + 1 for the rest."""
    layers = 1 + max((int(m.group(1)) for name, _ in model.named_parameters() if (m := _LAYER.search(name))),
                     default=-1)

    def scale(name: str) -> float:
        m = _LAYER.search(name)
        depth = int(m.group(1)) + 1 if m else 0 if _EMBEDDINGS.search(name) else layers + 1
        return decay ** (layers + 1 - depth)

    return scale


def _unwrapped(method):
    """`method` without the wrappers torch.optim puts around it (for torch.compile, and the profiler's hook that a
    torch optimizer's first construction adds to its class's step): the function they wrap; `method` itself in a
    torch without them."""
    return inspect.unwrap(method)


class _EagerOptimizer(torch.optim.Optimizer):
    """torch.optim wraps an optimizer's public methods so that torch.compile leaves them alone, and each wrapper
    imports torch._dynamo when first called: 1.9 s of every training process's start on a 2-core CPU, for a
    compiler that a run never applies to its optimizer (`--compile` compiles the encoder). These are the wrapped
    functions themselves, unchanged; only the import is left out."""

    add_param_group = _unwrapped(torch.optim.Optimizer.add_param_group)
    zero_grad = _unwrapped(torch.optim.Optimizer.zero_grad)
    state_dict = _unwrapped(torch.optim.Optimizer.state_dict)
    load_state_dict = _unwrapped(torch.optim.Optimizer.load_state_dict)

    def release_rows(self) -> None:
        """After training: an embedding trained on its looked-up rows back to an ordinary one (AdamW's)."""


class AdamW(_EagerOptimizer, torch.optim.AdamW):
    """torch's AdamW, its step the same arithmetic (the same fused kernel), without the compiler's wrapper; a task
    model's word embedding may train on its looked-up rows (`look_up_rows`, bertforge.train.rows: its update on
    bertforge's kernels, the same to rounding)."""

    _torch_step = staticmethod(_unwrapped(torch.optim.AdamW.step))  # once: every wrapper is unwrapped alike

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._looked_up: dict = {}  # weight -> (its LookedUpRows, its parameter group's index)

    def look_up_rows(self, embeddings: list[nn.Embedding]) -> bool:
        """Train `embeddings` on the rows their batches look up, where that applies (`rows.applies`). True if so."""
        if not rows.applies(self, embeddings):
            return False
        # a group by its index: load_state_dict puts new group dicts in param_groups, in the same order
        group_of = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._looked_up = {e.weight: (rows.LookedUpRows(e), group_of[e.weight]) for e in embeddings}
        return True

    def release_rows(self) -> None:
        for looked_up, _ in self._looked_up.values():
            looked_up.release()
        self._looked_up = {}

    def touched_rows(self, p: torch.Tensor) -> torch.Tensor | None:
        """The rows of `p`'s gradient that can be nonzero, where it trains on looked-up rows; else None (all)."""
        entry = self._looked_up.get(p)
        return entry[0].rows() if entry else None

    @torch.no_grad()  # what the wrapper does besides: the step does not record gradients
    def step(self, closure=None):
        if not self._looked_up:
            return self._torch_step(self, closure)
        for p in self._looked_up:  # torch's step leaves parameters without a gradient alone
            p.grad = None
        try:
            loss = self._torch_step(self, closure)
        finally:
            for p, (looked_up, _) in self._looked_up.items():
                p.grad = looked_up.buffer
        for p, (looked_up, group) in self._looked_up.items():
            rows.step(looked_up, self.state[p], self.param_groups[group], getattr(self, "grad_scale", None))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for looked_up, _ in self._looked_up.values():
            looked_up.zero()


def build_optimizer(model: nn.Module, *, name: str = "adamw", lr: float = 1e-4, weight_decay: float = 0.01,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, layer_lr_decay: float = 1.0,
                    looked_up_rows: bool = False) -> torch.optim.Optimizer:
    """BERT's AdamW (or LAMB) over `model`'s parameter groups. `looked_up_rows`: a task model's word embedding trains
    on the rows its batches look up, where that applies (bertforge.train.rows; one process, not under DDP)."""
    groups = parameter_groups(model, weight_decay, lr=lr, layer_lr_decay=layer_lr_decay)
    if name == "adamw":
        # fused=True is a single kernel over all tensors: measured 97 ms against 588 ms per step on BERT-Base
        # here (docs/design.md). It exists for CPU and CUDA floating-point parameters.
        optimizer = AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        lookups = getattr(model, "looked_up_embeddings", None)
        if looked_up_rows and lookups is not None:
            optimizer.look_up_rows(lookups())
        return optimizer
    if name == "lamb":
        return Lamb(groups, lr=lr, betas=betas, eps=eps)
    raise ValueError(f"unknown optimizer {name!r}; use adamw or lamb")


def clipped_step(optimizer: torch.optim.Optimizer, parameters, max_norm: float) -> float | torch.Tensor | None:
    """Clip the gradients of `parameters` to a total 2-norm of `max_norm` (0: no clipping), as torch's
    `clip_grad_norm_` does, then step `optimizer`. Returns the norm before clipping (a float, or on torch's path its
    0-dim tensor, on the gradients' device: reading it there would wait for the device), None without clipping.

    On a CPU where bertforge's kernels load, with fused AdamW over fp32 gradients, the norm is taken in one pass over
    every gradient (`grad_norm.h`) and the clipping factor is handed to the fused step (its `grad_scale`, which
    divides each gradient as it reads it) instead of multiplying every gradient in a pass of its own: 15 ms -> 4 ms
    of a 250 ms MiniLM-L6 fine-tuning step on a 2-core Xeon (docs/benchmarks.md). The result is torch's up to
    rounding: the norm's sums run in another order, and a gradient is divided by 1 / factor, not multiplied by it."""
    params = [p for p in parameters if p.grad is not None] if max_norm else []
    total = _kernel_norm(optimizer, params) if params else None
    if total is None:  # no clipping, or torch's
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else None
        optimizer.step()
        return norm
    scale = (total + 1e-6) / max_norm  # torch's clipping multiplies by max_norm / (total + 1e-6) where that is < 1
    optimizer.grad_scale = torch.tensor(scale, dtype=torch.float32) if scale > 1.0 else None  # fused AdamW reads it
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return total


def _kernel_norm(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> float | None:
    """The gradients' total 2-norm on the kernels where their path applies (and the norm is finite), else None. A
    gradient that is zero outside its looked-up rows is read there only (`AdamW.touched_rows`)."""
    if not (isinstance(optimizer, AdamW) and all(g.get("fused") for g in optimizer.param_groups)):
        return None
    grads = [p.grad for p in params]
    if not all(g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous() for g in grads):
        return None
    if not kernels.available():  # built or loaded on first use
        return None
    total = torch.ops.bertforge.grad_norm(grads, [optimizer.touched_rows(p) for p in params])
    return total if math.isfinite(total) else None  # torch's own path, which turns every gradient into NaN


def warmup_linear_decay(warmup_steps: int, total_steps: int):
    """lr multiplier: 0 -> 1 linearly over `warmup_steps`, then 1 -> 0 linearly at `total_steps`."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return step / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(warmup_steps, total_steps))


def set_total_steps(scheduler: torch.optim.lr_scheduler.LambdaLR, warmup_steps: int, total_steps: int) -> None:
    """Move the end of `build_scheduler`'s decay to `total_steps`, from the current step on (a re-planned time
    budget): the learning rate of the next step is set again under the new schedule."""
    factor = warmup_linear_decay(warmup_steps, total_steps)
    scheduler.lr_lambdas = [factor] * len(scheduler.optimizer.param_groups)
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


class Lamb(_EagerOptimizer):
    """LAMB (You et al. 2019): Adam's update rescaled per tensor by ||w|| / ||update||, for large batches.

    Decoupled weight decay is part of the update before the trust ratio, as in the paper's Algorithm 2.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm().item(), update.norm().item()
                trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 and math.isfinite(u_norm) else 1.0
                p.add_(update, alpha=-group["lr"] * trust)
        return loss
