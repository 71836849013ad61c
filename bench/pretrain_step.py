"""Training-step throughput: bertforge's BertForPreTraining against transformers', same config, same initial
weights, same batch (32 x 128 tokens, 15% of positions masked, NSP labels), same optimizer (AdamW, fused,
BERT's parameter groups), dropout on. Prints tokens/s for each side, the ratios, and each side's MFU: model
FLOPs per second over this machine's fp32 matmul peak, which is measured here (into a preallocated output, so
it is the arithmetic's peak, not the allocator's).

Each side runs in a child process of its own, the sides interleaved over two rounds, best kept:
- reference: transformers as it runs by default;
- reference, freed memory kept: the same under the allocator setting our training commands make on CPU
  (`bertforge.train.memory`: glibc keeps freed memory for reuse), to show what that setting alone is worth;
- ours: as `bertforge pretrain` runs it (with that setting).

Model FLOPs count the work a pretraining step needs: 6 x (encoder matmuls per token + attention scores) x
tokens, except that the last layer is needed at [CLS] and the masked positions only (its keys and values
everywhere), plus 6 x the MLM head (transform and vocabulary projection) on the masked positions, plus the
pooler and NSP head. The reference spends more (its last layer and MLM head run on every position); that is
wasted work, not credited.

With --precision bf16 every side runs under bf16 autocast (as `bertforge pretrain --precision bf16`), and
one more side, ours in fp32, shows what bf16 itself is worth on this CPU (it pays where the CPU has bf16
instructions, AVX512-BF16 or AMX). MFU stays relative to the fp32 matmul peak.

    .venv/bin/python bench/pretrain_step.py                     # tiny mini small base
    .venv/bin/python bench/pretrain_step.py --presets mini --steps 20
    .venv/bin/python bench/pretrain_step.py --presets mini small --precision bf16
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from bertforge import BertConfig, BertForPreTraining
from bertforge.checkpoint import to_hf_state_dict
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


def side_seconds(side: str, preset: str, steps: int, B: int, T: int, precision: str = "fp32") -> float:
    """Seconds per training step of one side ("ours", "ref", "ref-kept", "ours-fp32"), in this process."""
    import transformers

    if side != "ref" and not keep_freed_memory():
        sys.exit("the allocator setting is unavailable here (glibc only)")
    config = BertConfig.from_preset(preset)
    torch.manual_seed(0)
    model = BertForPreTraining(config).train()  # the same initial weights on every side
    ours = side.startswith("ours")
    bf16 = precision == "bf16" and side != "ours-fp32"
    if not ours:
        hf_config = transformers.BertConfig(**{k: v for k, v in config.to_dict().items()
                                               if k not in ("architectures", "id2label", "label2id")})
        ref = transformers.BertForPreTraining(hf_config).train()
        ref.load_state_dict(to_hf_state_dict(model), strict=False)
        model = ref
    inputs, types, mask, labels, nsp = make_batch(config.vocab_size, B, T)
    opt = build_optimizer(model, lr=1e-4)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if ours:
                loss = model(inputs, types, mask, mlm_labels=labels, nsp_labels=nsp).loss
            else:
                loss = model(input_ids=inputs, token_type_ids=types, attention_mask=mask, labels=labels,
                             next_sentence_label=nsp).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return time_steps(step, steps)


SIDES = ("ref", "ref-kept", "ours", "ours-fp32")


def bench(preset: str, steps: int, B: int, T: int, peak: float, precision: str) -> dict:
    """Each side in a child process, interleaved over two rounds so drift in machine load hits all alike."""
    sides = SIDES if precision == "bf16" else SIDES[:3]
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(2):
        for side in sides:
            out = subprocess.run([sys.executable, __file__, "--child", side, "--presets", preset, "--steps",
                                  str(steps), "--batch", str(B), "--seq", str(T), "--precision", precision],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if out.returncode:
                sys.exit(f"{side} {preset} failed:\n{out.stderr}")
            seconds[side].append(float(out.stdout.split()[-1]))
    best = {side: min(v) for side, v in seconds.items()}
    config = BertConfig.from_preset(preset)
    _, _, _, labels, _ = make_batch(config.vocab_size, B, T)
    flops = model_flops_per_step(config, B, T, int((labels != -100).sum()))
    return {"preset": preset, **{f"{side}_tok_s": B * T / best[side] for side in sides},
            "ratio": best["ref"] / best["ours"], "ratio_kept": best["ref-kept"] / best["ours"],
            "ratio_fp32": best["ours-fp32"] / best["ours"] if "ours-fp32" in best else None,
            **{f"{side}_mfu": flops / best[side] / 1e9 / peak for side in sides}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "mini", "small", "base"])
    p.add_argument("--steps", type=int, default=10, help="timed steps per side and round (2 rounds)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: every side under bf16 autocast, plus ours in fp32 for comparison")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)  # internal: time one side, print seconds
    args = p.parse_args()
    if args.child:
        print(side_seconds(args.child, args.presets[0], args.steps, args.batch, args.seq, args.precision))
        return
    import transformers

    peak = matmul_peak()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads "
          f"{torch.get_num_threads()}, fp32 matmul peak {peak:.0f} GFLOP/s, batch {args.batch} x {args.seq}, "
          f"{args.precision}")
    print(f"{'':8} {'tokens/s':^34} {'ours vs':^18} {'MFU':^24}")
    print(f"{'preset':8} {'reference':>10} {'ref, kept':>10} {'ours':>10}   {'ref':>7} {'ref,kept':>9}  "
          f"{'ref':>7} {'ref,kept':>8} {'ours':>7}")
    for preset in args.presets:
        steps = args.steps if preset != "base" else max(2, args.steps // 3)
        r = bench(preset, steps, args.batch, args.seq, peak, args.precision)
        bf16 = (f"   ours fp32 {r['ours-fp32_tok_s']:,.0f} tokens/s: bf16 {r['ratio_fp32']:.2f}x"
                if r["ratio_fp32"] else "")
        print(f"{preset:8} {r['ref_tok_s']:10,.0f} {r['ref-kept_tok_s']:10,.0f} {r['ours_tok_s']:10,.0f}   "
              f"{r['ratio']:6.2f}x {r['ratio_kept']:8.2f}x  {r['ref_mfu']:7.1%} {r['ref-kept_mfu']:8.1%} "
              f"{r['ours_mfu']:7.1%}{bf16}", flush=True)


if __name__ == "__main__":
    main()
