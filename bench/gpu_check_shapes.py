"""The GPU check's shapes part: why batches of many widths (dynamic padding, as `predict` and `finetune` make
them) ran 8-15x slower per token than the pretraining step's one width on the first H200 check, on both sides.

Each variant runs BERT-base over the same kind of batches twice: the first pass meets every width for the first
time, the second has seen them all, so a cost paid once per shape (a kernel plan built per width) shows as a
first pass much slower than the second. Each variant has its own batch size (64, 63, ...), so no variant finds
the shapes another one planned. Variants: transformers and bertforge as they come; bertforge with padded SDPA kept
off cuDNN's kernel (`encoder.CUDA_MASKED_BACKENDS`); bertforge with the widths rounded up to a multiple of 8; and
the fine-tuning step as it comes and off cuDNN. A profile of one batch of a new width says where its time goes.
"""

from __future__ import annotations

import torch
from gpu_check_speed import _free, _rate, hf_config, padded_batches

from bertforge import BertConfig, BertForSequenceClassification, BertModel, encoder
from bertforge.train.optim import build_optimizer

INFERENCE = ["transformers", "ours", "ours-no-cudnn", "ours-width-8", "transformers-no-cudnn"]
FINETUNE = ["ft-ours", "ft-ours-no-cudnn", "ft-transformers"]


def _no_cudnn() -> list:
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _round_widths(batches: list[dict], multiple: int) -> list[dict]:
    out = []
    for b in batches:
        width = b["input_ids"].shape[1]
        pad = -width % multiple
        out.append({k: torch.nn.functional.pad(v, (0, pad)) if v.dim() == 2 else v for k, v in b.items()})
    return out


def _model(variant: str, config: BertConfig, device: torch.device, train: bool):
    torch.manual_seed(0)
    hf = variant.startswith(("transformers", "ft-transformers"))
    if train:
        import transformers

        model = (transformers.BertForSequenceClassification(hf_config(config)) if hf
                 else BertForSequenceClassification(config))
        return model.train().to(device)
    if hf:
        import transformers

        return transformers.BertModel(hf_config(config)).eval().to(device, torch.bfloat16)
    return BertModel(config).eval().to(device, torch.bfloat16)


def _runner(model, train: bool, device: torch.device):
    if not train:
        def forward(b):
            with torch.inference_mode():
                model(**b)
        return forward
    opt = build_optimizer(model, lr=3e-5)

    def step(b):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _variant(ctx, variant: str, batch: int, sizes: tuple) -> dict:
    preset, T, n = sizes
    train = variant.startswith("ft-")
    config = BertConfig.from_preset(preset, num_labels=2, **({"vocab_size": 1000} if ctx.dry else {}))
    batches = padded_batches(config.vocab_size, batch, T, n, low=8, sort=not train, seed=batch)
    if not train:
        for b in batches:
            del b["labels"]
    if variant.endswith("width-8"):
        batches = _round_widths(batches, 8)
    _free(ctx.device)
    model = _model(variant, config, ctx.device, train)
    no_cudnn = variant.endswith("no-cudnn")
    encoder.CUDA_MASKED_BACKENDS = _no_cudnn() if no_cudnn else None
    flag = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(flag and not (no_cudnn and variant.startswith(("transformers", "ft-tr"))))
    try:
        run = _runner(model, train, ctx.device)
        warm = padded_batches(config.vocab_size, 3, 16, 1, low=16)[0]  # handles and allocator, on a width of its own
        run({k: v.to(ctx.device) for k, v in warm.items() if train or k != "labels"})
        first = _rate(run, batches, ctx.device, warm=0)
        second = _rate(run, batches, ctx.device, warm=0)
    finally:
        encoder.CUDA_MASKED_BACKENDS = None
        torch.backends.cuda.enable_cudnn_sdp(flag)
    return {"batch": batch, "first_pass_tokens_per_s": round(first), "second_pass_tokens_per_s": round(second),
            "widths": len({b["input_ids"].shape[1] for b in batches})}


def _profile(ctx, sizes: tuple) -> list[dict]:
    """The 12 costliest operators (self time, host and device) of one bertforge inference batch of a new width."""
    from torch.profiler import ProfilerActivity, profile

    preset, T, _ = sizes
    config = BertConfig.from_preset(preset, **({"vocab_size": 1000} if ctx.dry else {}))
    model = _model("ours", config, ctx.device, train=False)
    b = {k: v.to(ctx.device) for k, v in padded_batches(config.vocab_size, 40, T, 1, low=T - 3, seed=5)[0].items()
         if k != "labels"}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof, torch.inference_mode():
        model(**b)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        rows.append({"op": e.key[:80], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
                     "self_device_ms": round(device_us / 1e3, 2)})
    rows.sort(key=lambda r: -(r["self_cpu_ms"] + r["self_device_ms"]))
    return rows[:12]


def shapes(ctx) -> None:
    sizes = ("tiny", 32, 3) if ctx.dry else ("base", 128, 40)
    results: dict[str, dict] = {}
    for i, variant in enumerate(INFERENCE + FINETUNE):
        if ctx.left() < 8:
            results[variant] = {"skipped": "time box spent"}
            continue
        try:
            results[variant] = _variant(ctx, variant, (8 if ctx.dry else 64) - i, sizes)
        except Exception as e:  # recorded; the next variant runs
            results[variant] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        ctx.save(variants=results)
    if ctx.left() > 8:
        ctx.save(profile_new_width=_profile(ctx, sizes))
    cells = [f"{v} {r['first_pass_tokens_per_s']:,}/{r['second_pass_tokens_per_s']:,}"
             for v, r in results.items() if "first_pass_tokens_per_s" in r]
    ctx.save(headline="tokens/s first/second pass: " + "; ".join(cells))
