"""The GPU check's model parts: bf16 autocast against fp32 over 50 training steps, the pretraining step against
transformers (tokens/s, peak memory, MFU; eager and compiled), fine-tuning steps with dynamic padding and bf16
inference against transformers (fine-tuning also with bertforge's layers on the padded batch, `TrainingPacking`
off, to show what training on the real tokens alone gives). Each side runs on the same device, the same batches,
bf16 autocast and fused AdamW (bertforge's `build_optimizer`, BERT's parameter groups) on both sides, transformers
with SDPA attention.

The pretraining sides are bench/pretrain_step.py's (`side_seconds`: its "kept" sides, where keeping freed memory
is a CPU allocator setting that changes nothing on a GPU), and so are its batch and its FLOP count.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch
from gpu_check_env import matmul_rate
from measure import sync
from pretrain_step import make_batch, model_flops_per_step, side_seconds

from bertforge import BertConfig, BertForPreTraining, BertForSequenceClassification, BertModel
from bertforge.train.optim import build_optimizer
from bertforge.training_attention import TrainingPacking

# (preset, tokens, batch, vocabulary or None for the preset's): batches that fit an 80 GB card on both sides
# (transformers' MLM head runs on every position); the dry run's one tiny row proves the code path, on a small
# vocabulary (BERT's 30,522 made the reference's step 2.4 s in emulated bf16 on an AVX2 CPU, 15 s of the part).
PRETRAIN = [("base", 128, 256, None), ("base", 512, 32, None), ("large", 128, 128, None)]
PRETRAIN_DRY = [("tiny", 32, 8, 1000)]
# A side starts only with this much of the part's time box left (a compiled one compiles in its first step).
EAGER_SECONDS, COMPILE_SECONDS = 15, 60
FLOPS_NOTE = ("mfu: pretrain_step.model_flops_per_step, 3 x forward matmul FLOPs (2 per multiply-add) of the "
              "work a step needs: every layer's 4H^2+2HI matmuls and 2TH attention (scores and weighted sum) per "
              "position, the last layer and MLM head on [CLS] and the masked positions only; mfu_6nt: 6 x "
              "(parameters but position and type embeddings) x tokens + 12 x layers x T x H x tokens (the vocab "
              "projection on every position); both over the dense bf16 matmul rate measured in this part")


def hf_config(config: BertConfig):
    import transformers

    hf = transformers.BertConfig(**{k: v for k, v in config.to_dict().items()
                                    if k not in ("architectures", "id2label", "label2id")})
    hf._attn_implementation = "sdpa"
    return hf


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


# --- bf16 autocast against fp32 ----------------------------------------------------------------------------


def zipf_batch(V: int, B: int, T: int, seed: int) -> tuple[torch.Tensor, ...]:
    """`make_batch`'s batch with its tokens drawn from a Zipf law (weight 1/rank) rather than uniformly: a model
    learns the frequencies within 50 steps, so the loss curve falls and bf16 has a descent to follow."""
    inputs, types, mask, labels, nsp = make_batch(V, B, T, seed)
    g = torch.Generator().manual_seed(seed)
    tokens = 5 + torch.multinomial(1 / torch.arange(1, V - 4), B * T, replacement=True, generator=g).view(B, T)
    masked = labels != -100
    return torch.where(masked, inputs, tokens), types, mask, torch.where(masked, tokens, labels), nsp


def _curve(model, V: int, B: int, T: int, steps: int, bf16: bool, device: torch.device) -> list[float]:
    opt = build_optimizer(model, lr=3e-3)
    losses = []
    for step in range(steps):
        inputs, types, mask, labels, nsp = (t.to(device) for t in zipf_batch(V, B, T, seed=step))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(inputs, types, mask, mlm_labels=labels, nsp_labels=nsp).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def bf16_against_fp32(ctx) -> None:
    """50 steps from the same weights on the same batches (`zipf_batch`), in fp32 and under bf16 autocast.
    Tolerances: the first loss (same weights, forward only) within 1% (bf16's unit roundoff 2^-8 per matmul
    operand, averaged over the masked tokens: test_cuda's derivation); the mean of the last 10 losses within the
    fp32 curve's own step-to-step noise over 10 steps (3 s / sqrt(10), s the spread of its last 10 losses around
    their linear trend) or 1% of it, whichever is larger: bf16 must not move the curve more than the batches do."""
    preset, B, T, V = ("tiny", 4, 16, 500) if ctx.dry else ("mini", 32, 128, 30522)
    config = BertConfig.from_preset(preset, vocab_size=V, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if ctx.dry:
        config = config.replace(hidden_size=32, intermediate_size=64)
    curves = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        torch.manual_seed(0)
        model = BertForPreTraining(config).train().to(ctx.device)
        curves[name] = _curve(model, V, B, T, 50, bf16, ctx.device)
        ctx.save(model=f"{preset} vocab {V}", batch=[B, T], **{f"losses_{name}": [round(x, 5) for x in curves[name]]})
    fp32, bf16 = np.array(curves["fp32"]), np.array(curves["bf16"])
    x = np.arange(10)
    residual = fp32[-10:] - np.polyval(np.polyfit(x, fp32[-10:], 1), x)
    noise = float(residual.std(ddof=2))
    last_tol = max(3 * noise / np.sqrt(10), 0.01 * float(fp32[-10:].mean()))
    first_rel = abs(bf16[0] - fp32[0]) / fp32[0]
    last_diff = abs(bf16[-10:].mean() - fp32[-10:].mean())
    within = bool(first_rel <= 0.01 and last_diff <= last_tol)
    ctx.save(first_loss_rel_diff=float(first_rel), first_loss_tolerance=0.01, last10_mean_abs_diff=float(last_diff),
             last10_tolerance=float(last_tol), max_step_rel_diff=float(np.max(np.abs(bf16 - fp32) / fp32)),
             within_tolerance=within,
             headline=f"{'within' if within else 'OUTSIDE'} tolerance: first loss {first_rel:.2%} (<= 1%), last 10 "
                      f"mean {last_diff:.4f} (<= {last_tol:.4f}); losses {fp32[0]:.3f} -> {fp32[-1]:.3f}")


# --- the pretraining step ----------------------------------------------------------------------------------


def _pretrain_side(side: str, row: tuple, steps: int, peak: float, device) -> dict:
    preset, T, B, vocab = row
    _free(device)
    try:
        cold, seconds = side_seconds(side, preset, steps, B, T, "bf16", device, vocab_size=vocab)
    except (Exception, SystemExit) as e:  # an OOM or a compile failure: recorded, the next side runs
        _free(device)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    config = BertConfig.from_preset(preset, **({"vocab_size": vocab} if vocab else {}))
    masked = int((make_batch(config.vocab_size, B, T)[3] != -100).sum())
    L, H = config.num_hidden_layers, config.hidden_size
    with torch.device("meta"):  # counted, not allocated
        params = sum(p.numel() for p in BertForPreTraining(config).parameters())
    params -= (config.max_position_embeddings + config.type_vocab_size) * H
    flops_6nt = 6 * params * B * T + 12 * L * T * H * B * T
    peak_gib = _peak_gib(device)
    _free(device)
    return {"tokens_per_s": round(B * T / seconds), "step_ms": round(seconds * 1e3, 2), "cold_s": round(cold, 1),
            "peak_gib": peak_gib, "mfu": round(model_flops_per_step(config, B, T, masked) / seconds / peak, 4),
            "mfu_6nt": round(flops_6nt / seconds / peak, 4)}


def pretrain_speed(ctx) -> None:
    """Every row eager, ours and transformers'; ours compiled where the time box leaves room for compiling. The
    order is the goals': BERT-base at 128 first, eager and compiled, then large at 128, then base at 512."""
    peak = matmul_rate(ctx.device, 256 if ctx.dry else 8192) * 1e12
    rows = PRETRAIN_DRY if ctx.dry else PRETRAIN
    steps = 3 if ctx.dry else 10
    table: dict[str, dict] = {f"{p}/{T} x{B}": {} for p, T, B, _ in rows}
    ctx.save(matmul_bf16_tflops=round(peak / 1e12, 3), flops_note=FLOPS_NOTE, steps=steps, table=table)
    jobs = [(rows[0], s) for s in ("ref-kept", "ours-kept", "ours-compiled")]
    jobs += [(row, s) for row in rows[1:] for s in ("ref-kept", "ours-kept")]
    jobs += [(row, "ours-compiled") for row in rows[1:]]
    if getattr(ctx, "speed_jobs", None):  # --speed-jobs ROW:SIDE ...: these alone, in this order
        by_name = {f"{p}/{T}": (p, T, B, v) for p, T, B, v in rows}
        jobs = [(by_name[j.split(":")[0]], j.split(":")[1]) for j in ctx.speed_jobs if j.split(":")[0] in by_name]
    for (preset, T, B, vocab), side in jobs:
        needed = COMPILE_SECONDS if side.endswith("compiled") else EAGER_SECONDS
        if side.endswith("compiled") and ctx.dry:
            figures = {"skipped": "not in the dry run (compiling takes minutes on a CPU)"}
        elif ctx.left() < needed:
            figures = {"skipped": f"under {needed} s of the time box left"}
        else:
            figures = _pretrain_side(side, (preset, T, B, vocab), steps, peak, ctx.device)
        table[f"{preset}/{T} x{B}"][side] = figures
        ctx.save(table=table, headline=_speed_headline(table))


def _speed_headline(table: dict) -> str:
    def rate(sides: dict, side: str) -> float | None:
        return sides.get(side, {}).get("tokens_per_s")

    parts = []
    for key, sides in table.items():
        cells = []
        ref, ours = rate(sides, "ref-kept"), rate(sides, "ours-kept")
        if ref and ours:
            cells.append(f"{ours / ref:.2f}x MFU {sides['ours-kept']['mfu']:.0%}")
        comp, ref_comp = rate(sides, "ours-compiled"), rate(sides, "ref-compiled")
        if comp and ours:
            cells.append(f"compiled {comp / ours:.2f}x eager")
        if comp:
            cells.append(f"compiled MFU {sides['ours-compiled']['mfu']:.0%}")
        if comp and ref_comp:
            cells.append(f"compiled {comp / ref_comp:.2f}x transformers compiled")
        failed = [s for s, f in sides.items() if "error" in f or "skipped" in f]
        if failed:
            cells.append("not measured: " + ", ".join(failed))
        if cells:
            parts.append(f"{key.split()[0]} " + ", ".join(cells))
    return "ours/transformers: " + "; ".join(parts)


# --- fine-tuning and inference -----------------------------------------------------------------------------


def padded_batches(V: int, B: int, T: int, n: int, low: int, sort: bool = False, seed: int = 0) -> list[dict]:
    """n batches of B sequences of random lengths in [low, T], each padded to its own longest (dynamic padding);
    sorted by length first when `sort` (as `predict` batches a file)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, T + 1, (n * B,), generator=g)
    if sort:
        lengths = lengths.sort().values
    batches = []
    for i in range(n):
        lens = lengths[i * B:(i + 1) * B]
        width = int(lens.max())
        mask = (torch.arange(width) < lens[:, None]).long()
        ids = torch.randint(5, V, (B, width), generator=g) * mask
        batches.append({"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask,
                        "labels": torch.randint(0, 2, (B,), generator=g)})
    return batches


def _rate(run_batch, batches: list[dict], device: torch.device, warm: int = 2) -> float:
    """Real (not padding) tokens per second over the batches, after one warm-up pass over the first `warm`."""
    on = [{k: v.to(device) for k, v in b.items()} for b in batches]
    for b in on[:warm]:
        run_batch(b)
    sync(device)
    start = time.perf_counter()
    for b in on:
        run_batch(b)
    sync(device)
    return sum(int(b["attention_mask"].sum()) for b in batches) / (time.perf_counter() - start)


def finetune_speed(ctx) -> None:
    import transformers

    preset, B, T, n = ("tiny", 8, 32, 4) if ctx.dry else ("base", 32, 128, 30)
    config = BertConfig.from_preset(preset, num_labels=2, **({"vocab_size": 1000} if ctx.dry else {}))
    batches = padded_batches(config.vocab_size, B, T, n, low=8)
    rates = {}
    for side in ("transformers", "bertforge", "bertforge-padded"):  # the last: layers on the padded batch
        _free(ctx.device)
        torch.manual_seed(0)
        TrainingPacking.enabled = side != "bertforge-padded"
        model = (BertForSequenceClassification(config) if side.startswith("bertforge") else
                 transformers.BertForSequenceClassification(hf_config(config))).train().to(ctx.device)
        opt = build_optimizer(model, lr=3e-5)

        def step(b, model=model, opt=opt):
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                loss = model(**b).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        rates[side] = {"tokens_per_s": round(_rate(step, batches, ctx.device)), "peak_gib": _peak_gib(ctx.device)}
        ctx.save(model=preset, batch=B, max_len=T, batches=n, rates=rates)
        del model, opt
    TrainingPacking.enabled = True
    ours, padded = rates["bertforge"]["tokens_per_s"], rates["bertforge-padded"]["tokens_per_s"]
    r = ours / rates["transformers"]["tokens_per_s"]
    ctx.save(ratio=round(r, 3), packed_over_padded=round(ours / padded, 3),
             headline=f"{preset} x{B} <= {T} tokens, bf16: {r:.2f}x transformers ({ours:,} tokens/s; "
                      f"{ours / padded:.2f}x its layers on the padded batch)")


def inference_speed(ctx) -> None:
    import transformers

    preset, B, T, n = ("tiny", 8, 32, 4) if ctx.dry else ("base", 64, 128, 40)
    config = BertConfig.from_preset(preset, **({"vocab_size": 1000} if ctx.dry else {}))
    batches = padded_batches(config.vocab_size, B, T, n, low=8, sort=True)
    for b in batches:
        del b["labels"]
    rates = {}
    for side in ("transformers", "bertforge"):
        _free(ctx.device)
        torch.manual_seed(0)
        model = BertModel(config) if side == "bertforge" else transformers.BertModel(hf_config(config))
        model = model.eval().to(ctx.device, torch.bfloat16)

        def forward(b, model=model):
            with torch.inference_mode():
                model(**b)

        rates[side] = {"tokens_per_s": round(_rate(forward, batches, ctx.device)), "peak_gib": _peak_gib(ctx.device)}
        ctx.save(model=preset, batch=B, max_len=T, batches=n, weights="bf16", rates=rates)
        del model
    r = rates["bertforge"]["tokens_per_s"] / rates["transformers"]["tokens_per_s"]
    ctx.save(ratio=round(r, 3), headline=f"{preset} x{B} sorted <= {T} tokens, bf16 weights: {r:.2f}x transformers "
                                         f"({rates['bertforge']['tokens_per_s']:,} tokens/s)")
