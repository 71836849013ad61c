"""A task model's word embedding trained on the rows its batches look up.

Fine-tuning MiniLM-L6 on short texts, each batch of 32 looks up about 450 of the word embedding's 30,522 rows, yet
every step a dense gradient is zero-filled (47 MB), read by gradient clipping's norm and by AdamW, and AdamW
updates every row's moments. Here the embedding's gradient is instead one dense buffer kept across steps: the lookups'
gradients arrive as sparse rows (`nn.Embedding(sparse=True)`) and autograd adds them into it in place, only the rows
a step touched are zeroed after it, the norm reads only the blocks holding them (`grad_norm`'s rows: the same bits),
and AdamW runs on the kernels (`adamw_rows.h`): the rows ever looked up get the whole update, the others, whose
moments are still zero, only the weight decay that is all AdamW does to them. Measured in docs/benchmarks.md.

It applies where the word embedding is only looked up (task models: `BertPreTrainedModel.looked_up_embeddings`;
pretraining's tied masked-LM decoder reads the whole matrix), on the CPU with bertforge's kernels, in one process
(under DDP the gradients stay dense), to fused AdamW over fp32 weights. Its optimizer state is AdamW's own (exp_avg,
exp_avg_sq, step) plus `live`, the rows ever looked up; a checkpoint without it (an ordinary AdamW's) derives it
from the moments.
"""

from __future__ import annotations

import torch
from torch import nn

from bertforge import kernels


class LookedUpRows:
    """One embedding trained on its looked-up rows: its gradient buffer and the rows touched since the last step."""

    def __init__(self, embedding: nn.Embedding):
        self.embedding = embedding
        self.weight = embedding.weight
        self.buffer = torch.zeros_like(self.weight)
        self._touched: list[torch.Tensor] = []
        self._rows: torch.Tensor | None = None
        embedding.sparse = True
        self.weight.grad = self.buffer
        self._hook = self.weight.register_hook(self._record)

    def _record(self, grad: torch.Tensor) -> torch.Tensor:
        if grad.is_sparse:
            self._touched.append(grad._indices().reshape(-1))
        else:  # a dense gradient (the weight read some other way): every row may have changed
            self._touched.append(torch.arange(self.weight.shape[0], device=grad.device))
        self._rows = None
        return grad

    def rows(self) -> torch.Tensor:
        """The rows touched since the last step, sorted, each once."""
        if self._rows is None:
            touched = torch.cat(self._touched) if self._touched else torch.zeros(0, dtype=torch.long)
            self._rows = torch.unique(touched)
        return self._rows

    def zero(self) -> None:
        """After a step: the touched rows zeroed, the buffer the weight's gradient again."""
        if self._touched:
            self.buffer.index_fill_(0, self.rows(), 0.0)
        self._touched, self._rows = [], None
        self.weight.grad = self.buffer

    def release(self) -> None:
        """Back to an ordinary embedding with no gradient."""
        self._hook.remove()
        self.embedding.sparse = False
        self.weight.grad = None


# Below this many elements an embedding's dense gradient and AdamW stay in the caches and cost less than the sparse
# rows' bookkeeping. One step of a task model, both ways alternating in one process (2-core Xeon, batch 32, RT
# snippets): BERT-tiny over 8,000 word pieces (1.0M elements) 0.986x, BERT-mini over 8,000 (2.0M) 1.004x,
# BERT-tiny over 30,522 (3.9M) 1.064x, MiniLM-L6 (11.7M) 1.021-1.026x.
MIN_ELEMENTS = 1 << 21


def applies(optimizer: torch.optim.Optimizer, embeddings: list[nn.Embedding]) -> bool:
    """Whether `embeddings` can train this way under `optimizer`: fused AdamW training them, fp32 CPU weights of at
    least MIN_ELEMENTS, the kernels."""
    weights = [e.weight for e in embeddings]
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not all(id(w) in trained and w.requires_grad for w in weights):
        return False
    fused = all(g.get("fused") for g in optimizer.param_groups)
    cpu = all(w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 for w in weights)
    large = all(w.numel() >= MIN_ELEMENTS for w in weights)
    return bool(weights) and fused and cpu and large and kernels.available()


def step(rows: LookedUpRows, state: dict, group: dict, grad_scale: torch.Tensor | None) -> None:
    """AdamW's step of one looked-up embedding (`state`: its entry of the optimizer's state; `group`: its group)."""
    weight = rows.weight
    if "exp_avg" not in state:  # the layout torch's fused AdamW gives its state, so either can resume the other's
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
    if "live" not in state:  # a fresh state, or an ordinary AdamW's checkpoint: the rows whose moments moved
        state["live"] = (state["exp_avg"] != 0).any(1) | (state["exp_avg_sq"] != 0).any(1)
    elif state["live"].dtype != torch.bool:  # Optimizer.load_state_dict casts state to the weight's dtype
        state["live"] = state["live"] != 0
    state["live"].index_fill_(0, rows.rows(), True)
    state["step"] += 1
    beta1, beta2 = group["betas"]
    hyper = [float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"]),
             float(state["step"])]
    torch.ops.bertforge.adamw_rows(weight.detach(), rows.buffer, state["exp_avg"], state["exp_avg_sq"],
                                   state["live"], hyper, grad_scale)
