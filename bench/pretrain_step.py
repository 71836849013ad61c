"""Training-step throughput: bertforge's BertForPreTraining against transformers' in the same process.

Same config, same initial weights, same batch (32 x 128 tokens, 15% of positions masked, NSP labels), same
optimizer (AdamW, fused, BERT's parameter groups), dropout on. Prints tokens/s for each side, the ratio,
and each side's MFU: model FLOPs per second over this machine's fp32 matmul peak, which is measured here
(into a preallocated output, so it is the arithmetic's peak, not the allocator's).

Both sides run under the allocator setting our training commands make on CPU (`bertforge.train.memory`:
freed memory is kept for reuse; pass --system-malloc to leave glibc's default). It is process-wide, so the
reference gets it too: the ratio does not count it.

Model FLOPs count the work a pretraining step needs: 6 x (encoder matmuls per token + attention scores) x
tokens, except that the last layer is needed at [CLS] and the masked positions only (its keys and values
everywhere), plus 6 x the MLM head (transform and vocabulary projection) on the masked positions, plus the
pooler and NSP head. The reference spends more (its last layer and MLM head run on every position); that is
wasted work, not credited.

    .venv/bin/python bench/pretrain_step.py                     # tiny mini small base
    .venv/bin/python bench/pretrain_step.py --presets mini --steps 20
"""

from __future__ import annotations

import argparse
import time

import torch

from bertforge import BertConfig, BertForPreTraining
from bertforge.checkpoint import load_state, to_hf_state_dict
from bertforge.train.memory import keep_freed_memory
from bertforge.train.optim import build_optimizer


def matmul_peak(seconds: float = 1.0) -> float:
    """Best fp32 GFLOP/s over square and BERT-shaped matmuls."""
    best = 0.0
    for m, k, n in [(2048, 2048, 2048), (4096, 768, 3072), (4096, 3072, 768), (4096, 1024, 4096)]:
        a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
        torch.mm(a, b, out=c)
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 4:
            torch.mm(a, b, out=c)
            reps += 1
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
    return best


def model_flops_per_step(c: BertConfig, B: int, T: int, masked: int) -> float:
    L, H, inner, V = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    layer = 2 * (4 * H * H + 2 * H * inner) + 2 * 2 * T * H  # per position: matmuls + scores and weighted sum
    keys_values = 2 * 2 * H * H  # per position, in the last layer
    needed = B + masked  # positions the last layer computes in full: [CLS] and the masked ones
    encoder = (L - 1) * layer * B * T + keys_values * B * T + (layer - keys_values) * needed
    head = masked * (2 * H * H + 2 * H * V) + B * (2 * H * H + 2 * H * 2)
    return 3 * (encoder + head)


def make_batch(V: int, B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (B, T), generator=g)
    types = torch.zeros(B, T, dtype=torch.long)
    types[:, T // 2:] = 1
    mask = torch.ones(B, T, dtype=torch.long)
    chosen = torch.rand(B, T, generator=g) < 0.15
    chosen[:, 0] = False
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    inputs = torch.where(chosen, torch.full_like(ids, 4), ids)
    nsp = torch.randint(0, 2, (B,), generator=g)
    return inputs, types, mask, labels, nsp


def time_steps(step, steps: int) -> float:
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def bench(preset: str, steps: int, B: int, T: int, peak: float) -> dict:
    import transformers

    config = BertConfig.from_preset(preset)
    torch.manual_seed(0)
    ours = BertForPreTraining(config).train()
    hf_config = transformers.BertConfig(**{k: v for k, v in config.to_dict().items()
                                           if k not in ("architectures", "id2label", "label2id")})
    ref = transformers.BertForPreTraining(hf_config).train()
    ref.load_state_dict(to_hf_state_dict(ours), strict=False)
    load_state(ours, ref.state_dict(), verbose=False)
    inputs, types, mask, labels, nsp = make_batch(config.vocab_size, B, T)
    opt_ours = build_optimizer(ours, lr=1e-4)
    opt_ref = build_optimizer(ref, lr=1e-4)

    def step_ours():
        loss = ours(inputs, types, mask, mlm_labels=labels, nsp_labels=nsp).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def step_ref():
        loss = ref(input_ids=inputs, token_type_ids=types, attention_mask=mask, labels=labels,
                   next_sentence_label=nsp).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)

    # Interleave the two sides so drift in machine load hits both alike.
    t_ref, t_ours = [], []
    for _ in range(2):
        t_ref.append(time_steps(step_ref, steps))
        t_ours.append(time_steps(step_ours, steps))
    s_ref, s_ours = min(t_ref), min(t_ours)
    flops = model_flops_per_step(config, B, T, int((labels != -100).sum()))
    tokens = B * T
    return {"preset": preset, "ref_tok_s": tokens / s_ref, "ours_tok_s": tokens / s_ours, "ratio": s_ref / s_ours,
            "ref_mfu": flops / s_ref / 1e9 / peak, "ours_mfu": flops / s_ours / 1e9 / peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "mini", "small", "base"])
    p.add_argument("--steps", type=int, default=10, help="timed steps per side and round (2 rounds)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--system-malloc", action="store_true", help="leave glibc's allocator settings alone")
    args = p.parse_args()
    import transformers

    allocator = "glibc default" if args.system_malloc else \
        "freed memory kept" if keep_freed_memory() else "glibc default (setting unavailable)"

    peak = matmul_peak()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads "
          f"{torch.get_num_threads()}, fp32 matmul peak {peak:.0f} GFLOP/s, batch {args.batch} x {args.seq}, "
          f"allocator: {allocator}")
    print(f"{'preset':8} {'reference tok/s':>16} {'bertforge tok/s':>16} {'ratio':>7} {'ref MFU':>8} {'our MFU':>8}")
    for preset in args.presets:
        steps = args.steps if preset != "base" else max(2, args.steps // 3)
        r = bench(preset, steps, args.batch, args.seq, peak)
        print(f"{r['preset']:8} {r['ref_tok_s']:16,.0f} {r['ours_tok_s']:16,.0f} {r['ratio']:6.2f}x "
              f"{r['ref_mfu']:8.1%} {r['ours_mfu']:8.1%}", flush=True)


if __name__ == "__main__":
    main()
