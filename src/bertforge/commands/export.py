"""`bertforge export`: a model directory as an ONNX graph.

    bertforge export --format onnx --model runs/sst2 --out runs/sst2-onnx
    bertforge export --format onnx --model runs/mini --out mini.onnx

--out ending in .onnx writes just the graph; any other --out is a directory with model.onnx beside a copy of
the model's config, task and tokenizer files. Fine-tuned directories export their task outputs (logits, or
start_logits/end_logits for QA), others the encoder (last_hidden_state, pooler_output). Inputs: input_ids,
token_type_ids, attention_mask, (batch, tokens) int64, both axes dynamic. Needs `pip install bertforge[onnx]`.
"""

from __future__ import annotations

from dataclasses import dataclass

from bertforge.bounds import at_least
from bertforge.commands.arguments import Command
from bertforge.options import option


@dataclass
class ExportArgs:
    model: str = option(help="model directory (from `bertforge pretrain` or `bertforge finetune`)")
    out: str = option(help="a .onnx file, or a directory for model.onnx plus the config and tokenizer files")
    format: str = option("onnx", help="export format", choices=["onnx"])
    opset: int = option(17, help="ONNX opset version",
                         bound=at_least(17, "LayerNormalization is an ONNX operator from opset 17; the newest opsets "
                                            "are in the twenties", at_most=100))


def run_export(args: ExportArgs) -> int:
    from bertforge.export import export_onnx

    path = export_onnx(args.model, args.out, opset=args.opset)
    print(f"exported {args.model} to {path}")
    return 0


COMMANDS = [Command("export", ExportArgs, run_export, help="export a model to ONNX", description=__doc__)]
