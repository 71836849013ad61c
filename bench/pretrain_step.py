"""Training-step throughput: bertforge's BertForPreTraining against transformers', same config, same initial
weights, same batch (32 x 128 tokens, 15% of positions masked, NSP labels), same optimizer (AdamW, fused,
BERT's parameter groups), dropout on, the reference with SDPA attention, both on --device (default cpu).
Prints tokens/s for each side, the ratios, and each side's MFU: model FLOPs per second over this machine's
matmul peak, which is measured here (into a preallocated output, so it is the arithmetic's peak, not the
allocator's; on a CPU the faster of torch's product and oneDNN's, which differ on AMD CPUs: bertforge.linear).

The allocator matters on CPU: bertforge's training commands keep freed memory for reuse (glibc;
`bertforge.train.memory`), which makes big activations cheaper for any model. So every side runs both ways,
each in a child process of its own:
- ref / ours, system allocator: both as glibc runs them by default (how transformers users run);
- ref / ours, freed memory kept: both under bertforge's setting (how `bertforge pretrain` runs).
The headline ratio compares like with like: both sides with freed memory kept; the same ratio with the system
allocator on both sides is printed beside it, and so is "each as its users run it" (ours kept against the
reference on the system allocator), labelled as such.

The sides are interleaved over --rounds rounds (default 3) so drift in machine load hits all alike; each
round times --steps steps after 2 warm-up steps. The table shows the median tokens/s with min and max over
the rounds, and every ratio is of medians.

Model FLOPs count the work a pretraining step needs: 6 x (encoder matmuls per token + attention scores) x
tokens, except that the last layer is needed at [CLS] and the masked positions only (its keys and values
everywhere), plus 6 x the MLM head (transform and vocabulary projection) on the masked positions, plus the
pooler and NSP head. The reference spends more (its last layer and MLM head run on every position); that is
wasted work, not credited.

With --precision bf16 every side runs under bf16 autocast (as `bertforge pretrain --precision bf16`), and
one more side, ours in fp32 (freed memory kept), shows what bf16 itself is worth (on a CPU it pays where the
CPU has bf16 instructions, AVX512-BF16 or AMX). MFU stays relative to the fp32 matmul peak.

With --compile one more side, ours with the encoder compiled (`compile_encoder`, as `bertforge pretrain
--compile`; freed memory kept), is timed against ours eager; its cold start (the first step, which compiles) is
printed on its own line and is not part of the timed steps.

    .venv/bin/python bench/pretrain_step.py                     # tiny mini small base
    .venv/bin/python bench/pretrain_step.py --presets mini --steps 20
    .venv/bin/python bench/pretrain_step.py --presets mini small --precision bf16
    .venv/bin/python bench/pretrain_step.py --presets tiny mini --compile
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time

import torch
from measure import pin_device, ratio, spread, sync

from bertforge import BertConfig, BertForPreTraining
from bertforge.linear import has_onednn_linear
from bertforge.model_files import to_hf_state_dict
from bertforge.train.memory import keep_freed_memory
from bertforge.train.optim import build_optimizer, clipped_step


def matmul_peak(device: torch.device, seconds: float = 1.0) -> float:
    """Best fp32 GFLOP/s over square and BERT-shaped matmuls on `device`: torch's (MKL on a CPU) and, on a CPU,
    oneDNN's too, which runs AVX-512 on AMD CPUs where MKL runs AVX2 (`bertforge.linear`)."""
    best = 0.0
    for m, k, n in [(2048, 2048, 2048), (4096, 768, 3072), (4096, 3072, 768), (4096, 1024, 4096)]:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        c = torch.empty(m, n, device=device)
        calls = [functools.partial(torch.mm, a, b, out=c)]
        if device.type == "cpu" and has_onednn_linear():  # b.t(): a Linear's weight
            calls.append(functools.partial(torch.ops.mkldnn._linear_pointwise, a, b.t(), None, "none", [], ""))
        for call in calls:
            call()
            sync(device)
            reps, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds / 4:
                call()
                sync(device)
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


def time_steps(step, steps: int, device: torch.device) -> tuple[float, float]:
    """(seconds of the first step, which compiles when compiling, seconds per step after 2 warm-up steps)."""
    start = time.perf_counter()
    step()
    sync(device)
    cold = time.perf_counter() - start
    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return cold, (time.perf_counter() - start) / steps


# side -> (label, bertforge's model?, freed memory kept?)
SIDES = {
    "ref-sys": ("transformers, system allocator", False, False),
    "ours-sys": ("bertforge, system allocator", True, False),
    "ref-kept": ("transformers, freed memory kept", False, True),
    "ours-kept": ("bertforge, freed memory kept", True, True),
    "ours-fp32": ("bertforge fp32, freed memory kept", True, True),  # only with --precision bf16
    "ours-compiled": ("bertforge compiled, freed memory kept", True, True),  # only with --compile
    "ref-compiled": ("transformers compiled, freed memory kept", False, True),  # only with --compile
}


def side_seconds(side: str, preset: str, steps: int, B: int, T: int, precision: str, device: torch.device,
                 vocab_size: int | None = None) -> tuple[float, float]:
    """(cold first step, seconds per training step) of one side of SIDES, in this process; `vocab_size` replaces
    the preset's (the GPU check's dry run)."""
    return time_steps(side_step(side, preset, B, T, precision, device, vocab_size), steps, device)


def side_step(side: str, preset: str, B: int, T: int, precision: str, device: torch.device,
              vocab_size: int | None = None):
    """One training step of one side of SIDES, as a function of no arguments, on its own model and batch."""
    import transformers

    _, ours, kept = SIDES[side]
    if kept and not keep_freed_memory():
        sys.exit("the allocator setting is unavailable here (glibc only)")
    config = BertConfig.from_preset(preset, **({"vocab_size": vocab_size} if vocab_size else {}))
    torch.manual_seed(0)
    model = BertForPreTraining(config).train()  # the same initial weights on every side
    bf16 = precision == "bf16" and side != "ours-fp32"
    if not ours:
        hf_config = transformers.BertConfig(**{k: v for k, v in config.to_dict().items()
                                               if k not in ("architectures", "id2label", "label2id")})
        hf_config._attn_implementation = "sdpa"
        ref = transformers.BertForPreTraining(hf_config).train()
        ref.load_state_dict(to_hf_state_dict(model), strict=False)
        model = ref
    model = model.to(device)
    if side == "ours-compiled":
        model.compile_encoder()
    elif side == "ref-compiled":  # the way a transformers user compiles a model
        model = torch.compile(model)
    inputs, types, mask, labels, nsp = (t.to(device) for t in make_batch(config.vocab_size, B, T))
    opt = build_optimizer(model, lr=1e-4)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if ours:
                loss = model(inputs, types, mask, mlm_labels=labels, nsp_labels=nsp).loss
            else:
                loss = model(input_ids=inputs, token_type_ids=types, attention_mask=mask, labels=labels,
                             next_sentence_label=nsp).loss
        loss.backward()
        if ours:  # as bertforge's training steps clip (on its kernels where they load)
            clipped_step(opt, model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def bench(preset: str, steps: int, B: int, T: int, peak: float, args: argparse.Namespace) -> dict[str, list[float]]:
    """Tokens/s of each side per round; each side in a child process, interleaved over the rounds so drift in
    machine load hits all alike."""
    optional = {"ours-fp32": args.precision == "bf16", "ours-compiled": args.compile, "ref-compiled": args.compile}
    sides = [s for s in SIDES if optional.get(s, True)]
    rates: dict[str, list[float]] = {side: [] for side in sides}
    cold: list[float] = []
    for r in range(args.rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:  # rotate: no side always first
            out = subprocess.run([sys.executable, __file__, "--child", side, "--presets", preset, "--steps",
                                  str(steps), "--batch", str(B), "--seq", str(T), "--precision", args.precision,
                                  "--device", args.device],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if out.returncode:
                sys.exit(f"{side} {preset} failed:\n{out.stderr}")
            first, seconds = map(float, out.stdout.split()[-2:])
            rates[side].append(B * T / seconds)
            if side == "ours-compiled":
                cold.append(first)
    return rates, cold


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "mini", "small", "base"])
    p.add_argument("--steps", type=int, default=10, help="timed steps per side and round (base: a third)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the median over rounds is reported")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: every side under bf16 autocast, plus ours in fp32 for comparison")
    p.add_argument("--device", default="cpu", help="where every side runs (cpu, cuda, cuda:1, ...)")
    p.add_argument("--compile", action="store_true", help="also time ours with the encoder compiled")
    p.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)  # internal: time one side
    args = p.parse_args()
    device = pin_device(args.device)
    if args.child:
        print(*side_seconds(args.child, args.presets[0], args.steps, args.batch, args.seq, args.precision, device))
        return
    import transformers

    peak = matmul_peak(device)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}, threads "
          f"{torch.get_num_threads()}, fp32 matmul peak {peak:.0f} GFLOP/s, batch {args.batch} x {args.seq}, "
          f"{args.precision}; median (min-max) over {args.rounds} rounds")
    for preset in args.presets:
        steps = args.steps if preset != "base" else max(2, args.steps // 3)
        rates, cold = bench(preset, steps, args.batch, args.seq, peak, args)
        config = BertConfig.from_preset(preset)
        _, _, _, labels, _ = make_batch(config.vocab_size, args.batch, args.seq)
        flops = model_flops_per_step(config, args.batch, args.seq, int((labels != -100).sum()))
        print(f"\n{preset}: tokens/s, median (min-max); MFU at the median")
        for side, values in rates.items():
            mfu = flops * statistics.median(values) / (args.batch * args.seq) / 1e9 / peak
            print(f"  {SIDES[side][0]:<38} {spread(values, ',.0f'):>26}  MFU {mfu:6.1%}")
        print(f"  bertforge vs transformers, same allocator (headline): "
              f"{ratio(rates['ours-kept'], rates['ref-kept']):.2f}x with freed memory kept, "
              f"{ratio(rates['ours-sys'], rates['ref-sys']):.2f}x with the system allocator")
        print(f"  each as its users run it (bertforge keeps freed memory, transformers does not): "
              f"{ratio(rates['ours-kept'], rates['ref-sys']):.2f}x")
        if "ours-fp32" in rates:
            print(f"  bf16 autocast vs fp32, ours: {ratio(rates['ours-kept'], rates['ours-fp32']):.2f}x", flush=True)
        if "ours-compiled" in rates:
            print(f"  compiled vs eager, ours: {ratio(rates['ours-compiled'], rates['ours-kept']):.2f}x; cold start "
                  f"(compile + first step, not timed above): {spread(cold, '.1f')} s", flush=True)


if __name__ == "__main__":
    main()
