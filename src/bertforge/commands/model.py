"""`bertforge model info` and `bertforge model smoke`."""

from __future__ import annotations

from dataclasses import dataclass

from bertforge.commands.arguments import Command
from bertforge.options import option, step_count


@dataclass
class ModelInfoArgs:
    model: str = option("base", help="a preset (tiny, mini, small, medium, base, large), config.json or model "
                                     "directory")


def _load_config(spec: str):
    from pathlib import Path

    from bertforge.config import PRESETS, BertConfig

    if spec in PRESETS:
        return BertConfig.from_preset(spec)
    return BertConfig.from_json(Path(spec))


def model_info(args: ModelInfoArgs) -> None:
    """Print the configuration, parameter counts and training FLOPs per token."""
    from bertforge.models import BertForPreTraining

    config = _load_config(args.model)
    import torch

    with torch.device("meta"):
        model = BertForPreTraining(config)
    total = sum(p.numel() for p in model.parameters())
    embed = sum(p.numel() for p in model.bert.embeddings.parameters())
    L, H, inner = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    per_token = 2 * L * (4 * H * H + 2 * H * inner)  # forward multiply-adds of the encoder's matmuls
    print(f"model: {args.model}")
    for key, value in config.to_dict().items():
        if key not in ("model_type", "position_embedding_type"):
            print(f"  {key}: {value}")
    print(f"parameters: {total:,} ({total / 1e6:.1f}M; embeddings {embed / 1e6:.1f}M, encoder and heads "
          f"{(total - embed) / 1e6:.1f}M)")
    print(f"encoder forward FLOPs per token (matmuls, excluding attention scores): {per_token / 1e6:.1f}M")
    if config.pre_layer_norm:
        print("transformers: cannot load this model: its layers are pre-LN (pre_layer_norm), and transformers' "
              "BertModel has post-LN layers only; use bertforge to load it")
    else:
        print("transformers: loads as BertModel / BertForPreTraining (post-LN layers, Hugging Face names)")


@dataclass
class SmokeArgs:
    model: str = option("mini", help="a preset or config.json")
    steps: int = option(20, help="training steps on random tokens", bound=step_count(1))
    out: str | None = option(None, help="directory to save the final model into (default: a temporary directory)")


def smoke(args: SmokeArgs) -> None:
    """Train a few steps on a fixed random batch, save, reload, and check the outputs agree."""
    import tempfile

    import torch

    from bertforge.models import BertForPreTraining

    torch.manual_seed(0)
    config = _load_config(args.model).replace(vocab_size=1000, max_position_embeddings=128)
    model = BertForPreTraining(config)
    B, T = 8, 64
    ids = torch.randint(5, config.vocab_size, (B, T))
    labels = torch.where(torch.rand(B, T) < 0.15, ids, torch.full_like(ids, -100))
    inputs = torch.where(labels != -100, torch.full_like(ids, 4), ids)
    nsp = torch.randint(0, 2, (B,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = model(inputs, mlm_labels=labels, nsp_labels=nsp).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in (0, args.steps - 1):
            print(f"step {step + 1}: loss {loss.item():.3f}")
    out = args.out or tempfile.mkdtemp(prefix="bertforge-smoke-")
    model.eval().save_pretrained(out)
    back = BertForPreTraining.from_pretrained(out).eval()
    with torch.no_grad():
        same = torch.equal(model(inputs).nsp_logits, back(inputs).nsp_logits)
    print(f"saved to {out}; reloaded outputs identical: {same}")


COMMANDS = [
    Command("model info", ModelInfoArgs, model_info, help="show a model's sizes, parameters and FLOPs"),
    Command("model smoke", SmokeArgs, smoke, help="train a few steps on random tokens, save and reload"),
]
