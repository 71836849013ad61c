"""Inference on new text: fill-mask, task predictions (classification, regression, NER, QA, multiple choice)
and embeddings, from Python and the command line.

Speed on CPU comes from six choices, each measured by bench/inference.py (the kernels by bench/int8_kernels.py):
- no computing on padding beyond what a batch needs: inputs are sorted by length and batched by a token
  budget, so each batch is padded only to its own longest sequence, and results are put back in input order;
- in fp32 and bf16 where bertforge's kernels do not load, no computing on padding in the products at all: an
  encoder runs a batch's real tokens packed into one matrix, and pads them only for the attention (`packing`),
  which counts most for a batch of random lengths, such as a group of the server's concurrent requests;
- every Linear layer's weight laid out once for oneDNN's matrix kernels (`pack_linears`): the matrix products
  are most of the time on short texts, and torch's nn.Linear hands fp32 ones to MKL, which packs the weight
  anew on every call (on the AMD EPYC we measure on, 1.2-1.4x slower than oneDNN on the packed weight); a short
  text's few rows go to bertforge's own fp32 product instead, and a classifier's narrow head to PyTorch's
  (`PackedLinear`): at a few rows oneDNN's products run well under their full speed, and its fixed cost of about
  15 us a call is most of a small product's time;
- a narrower number format where the CPU multiplies it natively: `EngineOptions(precision="bf16")` (the whole
  model in bfloat16, on CPUs with AVX512-BF16 or AMX) or `quantize="int8"` (int8 Linear layers, the rest fp32:
  with VNNI 8-bit weights on oneDNN, int32 sums; on AVX2 alone 7-bit weights and activations in 7 bits per row on
  bertforge's kernels, so that four products sum in int16; attention over short texts in bf16 where the CPU has
  it, which is faster there than fp32's fused kernel);
- for int8 and fp32 on an AVX-512 or AVX2 CPU, bertforge's own kernels between the products (`bertforge.kernels`,
  built on first use): each layer's attention in one pass per sequence, each residual add + LayerNorm in one pass
  per row, and (int8) the activation ranges handed to the next product (`fused.FusedEncoder`); narrow int8
  encoders (up to 512 wide) and fp32 ones (BERT-tiny's 128; wider ones a text served alone) a sequence at a time,
  each sequence's layers one after another in the core's caches, a lone text's work shared out over the threads; in
  bf16 the attention
  (`fused.KernelSelfAttention`);
- two batches at a time, each on half the threads, where there are 2 or more threads and 4 or more batches
  (`bertforge.batching`): small products use a CPU's threads better side by side than split.

The package by job: `engines` (Encoder, MaskFiller, Predictor), `transforms` (the model rewritten for the CPU: int8
Linear layers, and `packed_linear`'s fp32 and bf16 ones), `fused` (the encoder on the kernels between its products),
`packing` (the unpadded encoder), `checks` (the device and dtype an engine's options give on this machine). The
options themselves, checked together, are one `bertforge.options.EngineOptions` (also importable from here). Reading
the command line's input files is the CLI's (`bertforge.commands.inputs`).
"""

from bertforge.infer.engines import Encoder, MaskFiller, Predictor, predict_records
from bertforge.infer.fused import FusedEncoder
from bertforge.infer.packed_linear import PackedLinear
from bertforge.infer.transforms import INT8_BF16_ATTENTION_MAX_T, Int8Linear, pack_linears, quantize_int8
from bertforge.options import EngineOptions

__all__ = ["INT8_BF16_ATTENTION_MAX_T", "Encoder", "EngineOptions", "FusedEncoder", "Int8Linear", "MaskFiller",
           "PackedLinear", "Predictor", "pack_linears", "predict_records", "quantize_int8"]
