"""Encoders run on bertforge's CPU kernels between their products (`FusedEncoder`): int8 ones (`quantize_int8`) and
fp32 ones (`prepare`'s packed fp32 path). The products are the layers' own (`transforms.Int8Linear`,
`packed_linear.PackedLinear`, the GELU inside the feed-forward's first); the attention and the residual add +
LayerNorm between them are the kernels'. For fp32 on a 2-core Xeon with AMX (bench/inference.py --fp32-operators):
a file of Rotten Tomatoes snippets 1.10x (fine-tuned MiniLM-L6) and 1.21x (BERT-tiny) faster than on PyTorch's
operators, one text 1.22x and 1.17x sooner, the logits within 4e-7."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bertforge import kernels
from bertforge.encoder import BertEmbeddings, BertEncoder, BertLayer, BertSelfAttention
from bertforge.infer.packed_linear import PANEL_MAX_ROWS
from bertforge.training_attention import TrainingPacking


class FusedEncoder(nn.Module):
    """A `BertEncoder` of int8 or fp32 layers (its own modules, same weights) run on bertforge's CPU kernels
    (`bertforge.kernels`) between its products: each layer's attention in one pass per sequence, each residual add
    + LayerNorm in one pass per row, and the activation range each of them gives handed to an int8 product that
    follows, which then skips its own pass to find it (on the VNNI kernels, which quantize each row by its own
    range, and in fp32, it goes unused). Post-LN and pre-LN layers alike. Batches longer than `max_positions` run
    the layers as they are.

    Int8 layers on the VNNI or u7 kernels can instead run a sequence at a time (`by_sequence`; the kernels'
    int8_encoder.h): every layer of one sequence before the next sequence, its activations kept in the core's caches,
    the same results bit for bit; fp32 layers too, on the kernels' fp32 products (`by_sequence_fp32`; fp32_encoder.h),
    the same bits as those products run operator by operator."""

    def __init__(self, encoder: BertEncoder, max_positions: int):
        super().__init__()
        self.plain = encoder  # the same layers, run as they are past max_positions
        self.max_positions = max_positions
        self.sequence_weights: list[torch.Tensor] | None = None  # by_sequence's operands
        self.sequence_eps: list[float] = []
        self.sequence_u7 = False  # by_sequence's products: the u7 kernels' (7-bit) rather than the VNNI kernels'
        self.sequence_fp32 = False  # by_sequence's products: the kernels' fp32 ones (`by_sequence_fp32`)
        self.sequence_short_t = 0  # batches of sequences this short run a sequence at a time however few they are
        # > 0: only batches of fewer sequences than threads run a sequence at a time, and only while this short (0:
        # batches of as many sequences as threads or more always do)
        self.sequence_lone_t = 0

    def by_sequence(self) -> None:
        """Run on the kernels' int8_encoder from now on. With fewer sequences than threads (a text served alone) the
        operator shares each sequence's products and attention out over the threads, except on AMX tiles (each
        thread's own), where it runs such batches only while they are short (`AMX_SHORT_T`; else a thread's one
        sequence would run alone, where the products split it over the threads). Every layer's products must be
        `transforms.Int8Linear`s on the VNNI kernels (8-bit weights) or all on the u7 kernels (7-bit, CPUs without
        int8 dot products)."""
        self.sequence_u7 = self.layer[0].attention.qkv.vnni is None
        tiles = not self.sequence_u7 and torch.ops.bertforge.amx_tiles()
        self.sequence_short_t = AMX_SHORT_T if tiles else self.max_positions
        # a product's 4: its panels and column sums (u7's or VNNI's), weight scales and bias
        self._sequence_operands(lambda p: [*(p.u7 if self.sequence_u7 else p.vnni), p.weight_scale, _bias(p)])

    def by_sequence_fp32(self, lone_only: bool = False) -> None:
        """Run on the kernels' f32_encoder from now on (fp32 `packed_linear.PackedLinear` layers): `by_sequence`'s
        loop over the kernels' few-row fp32 products (fp32_panels.h), each layer's weights packed for them once.
        `lone_only`: only batches of fewer sequences than threads (a text served alone) of at most
        `packed_linear.PANEL_MAX_ROWS` tokens, the products the layers take to the same kernel operator by operator
        (for encoders whose layers' weights do not stay in a core's L2: their batches run faster by operator)."""
        self.sequence_fp32, self.sequence_short_t = True, 0 if lone_only else self.max_positions
        self.sequence_lone_t = PANEL_MAX_ROWS if lone_only else 0
        self._sequence_operands(lambda p: [p.kernel_panels(), _bias(p)])  # a product's 2: its panels and bias

    def _sequence_operands(self, operands: Callable[[nn.Module], list[torch.Tensor]]) -> None:
        """The encoder operator's weights and eps: for each layer its four products' `operands`, then its two
        LayerNorms' weight and bias; pre-LN, the final LayerNorm's after the last layer."""
        weights, eps = [], []

        def add(norm: nn.LayerNorm) -> None:
            weights.extend(t.detach().float().contiguous() for t in (norm.weight, norm.bias))
            eps.append(norm.eps)

        for layer in self.layer:
            for product in _layer_products(layer):
                weights += operands(product)
            add(layer.attention_norm)
            add(layer.output_norm)
        if self.final_norm is not None:
            add(self.final_norm)
        self.sequence_weights, self.sequence_eps = weights, eps

    @property
    def products(self) -> list[nn.Module]:
        """Every layer's four products, layer by layer: query/key/value, attention output, intermediate, output."""
        return [p for layer in self.layer for p in _layer_products(layer)]

    @property
    def layer(self) -> nn.ModuleList:
        return self.plain.layer

    @property
    def final_norm(self) -> nn.LayerNorm | None:
        """Pre-LN layers: the LayerNorm after the last."""
        return self.plain.final_norm

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """As `BertEncoder.forward`: x (B, T, H), mask (B, 1, 1, T) bool or None, positions (B, P) or None."""
        if x.shape[1] > self.max_positions:
            return self.plain(x, mask, positions)
        keys = None if mask is None else mask[:, 0, 0, :]
        if self._by_sequence(*x.shape[:2]):
            if self.sequence_fp32:
                return torch.ops.bertforge.f32_encoder(x, keys, positions, self.sequence_weights,
                                                       self.layer[0].attention.num_heads, self.sequence_eps,
                                                       self.final_norm is not None)
            return torch.ops.bertforge.int8_encoder(x, keys, positions, self.sequence_weights,
                                                    self.layer[0].attention.num_heads, self.sequence_eps,
                                                    self.final_norm is not None, self.sequence_u7)
        if self.final_norm is not None:
            return self._pre_ln(x, keys, positions)
        last = len(self.layer) - 1
        bounds = None
        for i, layer in enumerate(self.layer):
            x, bounds = _fused_layer(layer, x, keys, positions if i == last else None, bounds)
        return x

    def _by_sequence(self, sequences: int, length: int) -> bool:
        """Does a batch of `sequences` sequences of `length` positions run a sequence at a time?"""
        if self.sequence_weights is None:
            return False
        few = sequences < torch.get_num_threads()
        if self.sequence_lone_t:
            return few and length <= self.sequence_lone_t
        return not few or length <= self.sequence_short_t

    def _pre_ln(self, x: torch.Tensor, keys: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
        """Pre-LN layers, x = x + Attn(LN(x)); x = x + FFN(LN(x)), then the final LayerNorm: each LayerNorm fused
        with the residual add before it, keeping the sum as the residual stream."""
        ops = torch.ops.bertforge
        norm = self.layer[0].attention_norm
        x, normed, bounds = ops.residual_layer_norm(x, None, norm.weight, norm.bias, norm.eps)
        last = len(self.layer) - 1
        for i, layer in enumerate(self.layer):
            attention = layer.attention
            y, y_bounds = ops.attention(attention.qkv(normed, bounds), attention.num_heads, keys,
                                        positions if i == last else None)
            if i == last and positions is not None:
                x = x.gather(1, positions[..., None].expand(-1, -1, x.shape[2]))
            norm = layer.output_norm
            x, normed, bounds = ops.residual_layer_norm(layer.attention_out(y, y_bounds), x, norm.weight, norm.bias,
                                                        norm.eps)
            out = layer.output(layer.intermediate(normed, bounds))
            norm = self.final_norm if i == last else self.layer[i + 1].attention_norm
            x, normed, bounds = ops.residual_layer_norm(out, x, norm.weight, norm.bias, norm.eps)
        return normed


def _layer_products(layer: BertLayer) -> tuple[nn.Module, ...]:
    return layer.attention.qkv, layer.attention_out, layer.intermediate, layer.output


def _bias(product: nn.Module) -> torch.Tensor:
    """A product's bias as the kernels read it: fp32, contiguous, zeros where it has none."""
    if product.bias is None:
        return torch.zeros(product.out_features)
    return product.bias.detach().float().contiguous()


def _fused_layer(layer: BertLayer, x: torch.Tensor, keys: torch.Tensor | None, positions: torch.Tensor | None,
                 bounds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`BertLayer.forward` (post-LN, eval) on the kernels: (output, its (min, max))."""
    ops = torch.ops.bertforge
    attention = layer.attention
    y, y_bounds = ops.attention(attention.qkv(x, bounds), attention.num_heads, keys, positions)
    if positions is not None:
        x = x.gather(1, positions[..., None].expand(-1, -1, x.shape[2]))
    norm = layer.attention_norm
    x, x_bounds = ops.add_layer_norm(layer.attention_out(y, y_bounds), x, norm.weight, norm.bias, norm.eps)
    norm = layer.output_norm
    return ops.add_layer_norm(layer.output(layer.intermediate(x, x_bounds)), x, norm.weight, norm.bias, norm.eps)


# The longest batches the fused encoder runs; longer ones run PyTorch's operators.
FUSED_MAX_T = 512

# On AMX tiles, batches of sequences this short run a sequence a time (`FusedEncoder.by_sequence`) however few they
# are: one text was answered sooner on one thread that way than on two operator by operator (2-core Xeon, p50 of 200
# texts; MiniLM-L6 fine-tuned, BERT-tiny distilled). Rotten Tomatoes snippets (27 tokens on average): MiniLM-L6 2.06
# against 3.28 ms, BERT-tiny 0.74 against 0.98; three or four snippets joined (about 75 tokens): 3.4-3.6 against
# 5.5-6.1 ms and 0.76-0.78 against 0.84-1.03. Without tiles the operator shares a lone sequence out over the threads
# instead, and every length runs on it: one MiniLM-L6 encoder pass on a 2-core Zen 4 (VNNI) at 27 tokens 1.06 ms
# against 1.69 on one thread and 1.36 operator by operator, at 64 2.56 against 4.14 and 2.77, at 128 5.44 against
# 9.34 and 5.63; on the u7 kernels (7-bit, AVX2) the same as operator by operator or better.
AMX_SHORT_T = 128


def fuse_encoders(model: nn.Module, is_product: Callable[[nn.Module], bool]) -> list[FusedEncoder]:
    """Every BertEncoder of `model` whose layers' four products are all `is_product` (what the kernels expect between
    them), the feed-forward's GELU inside its first, with heads of a multiple of 16, replaced by a `FusedEncoder` of
    the same layers, in place, where bertforge's CPU kernels are available; the new encoders."""

    def fusable(encoder: BertEncoder) -> bool:
        return all(isinstance(layer.attention, BertSelfAttention)
                   and all(is_product(m) for m in (layer.attention.qkv, layer.attention_out, layer.intermediate,
                                                   layer.output))
                   and layer.intermediate.activation == "gelu" and isinstance(layer.act, nn.Identity)
                   and layer.attention.head_size % 16 == 0  # so the hidden size too
                   and layer.pre_ln == (encoder.final_norm is not None) for layer in encoder.layer)

    encoders = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
                if isinstance(child, BertEncoder) and fusable(child)]
    if not encoders or not kernels.available():
        return []
    fused = []
    for parent, name, encoder in encoders:
        fused.append(FusedEncoder(encoder, FUSED_MAX_T))
        setattr(parent, name, fused[-1])
        embeddings = getattr(parent, "embeddings", None)
        if isinstance(embeddings, BertEmbeddings) and embeddings.word_embeddings.embedding_dim % 16 == 0:
            parent.embeddings = FusedEmbeddings(embeddings)
    return fused


class _Wrapper(nn.Module):
    """A module standing in for another (its submodule named `wrapped`), which answers for the attributes it lacks."""

    wrapped = ""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules[self.wrapped], name)


class FusedEmbeddings(_Wrapper):
    """A `BertEmbeddings` (the same module, its tables and LayerNorm) run on the kernels' `embeddings` in eval mode:
    each row's three embeddings summed and normalized in one pass, where PyTorch's operators take five (two
    gathers, two adds, the LayerNorm), each over the whole batch. Training runs the module as it is."""

    wrapped = "plain"  # word_embeddings & co. (the masked-LM decoder is tied to the word embeddings)

    def __init__(self, embeddings: BertEmbeddings):
        super().__init__()
        self.plain = embeddings

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        e = self.plain
        if self.training or input_ids.device.type != "cpu" or e.word_embeddings.weight.dtype != torch.float32:
            return e(input_ids, token_type_ids)
        norm = e.LayerNorm
        return torch.ops.bertforge.embeddings(input_ids, token_type_ids, e.word_embeddings.weight,
                                              e.position_embeddings.weight, e.token_type_embeddings.weight,
                                              norm.weight, norm.bias, norm.eps)


class KernelSelfAttention(_Wrapper):
    """A `BertSelfAttention` in eval mode on the kernels' attention operator, for bf16 models (`transforms.prepare`):
    its query/key/value product as it is (a bf16 `PackedLinear`), then each sequence's scores, softmax and weighted
    values in one pass, in fp32 from the bf16 rows, the output back in bf16. On PyTorch's operators a bf16 model's
    attention scattered its heads out and back and ran batched products, a softmax and a mask apart: MiniLM-L6 over
    Rotten Tomatoes test on a 2-core Zen 4 ran 1.04-1.14x faster this way (with the GELU inside the product), one
    text 1.3-2.0x sooner; IMDB reviews embedded at about 75 tokens 1.32x, 180 tokens 1.04x, 260 1.03x, whole (up to
    512) 0.96-0.98x. Training, packed calls and other devices run the module it wraps."""

    wrapped = "inner"  # num_heads, qkv, dropout_p & co.

    def __init__(self, attention: BertSelfAttention):
        super().__init__()
        self.inner = attention
        self.train(attention.training)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None = None,
                packing: TrainingPacking | None = None) -> torch.Tensor:
        """As `BertSelfAttention.forward`."""
        inner = self.inner
        if self.training or packing is not None or x.device.type != "cpu":
            return inner(x, mask, positions, packing)
        keys = None if mask is None else mask[:, 0, 0, :]
        y, _ = torch.ops.bertforge.attention(inner.qkv(x), inner.num_heads, keys, positions)
        return y.to(x.dtype)


def kernel_attention(model: nn.Module, is_product: Callable[[nn.Module], bool]) -> int:
    """Every `BertSelfAttention` whose query/key/value product is `is_product`, with heads of a multiple of 16,
    replaced by a `KernelSelfAttention` of it, in place, where bertforge's CPU kernels are available; how many."""
    if not kernels.available():
        return 0
    layers = [layer for layer in model.modules() if isinstance(layer, BertLayer)
              and isinstance(layer.attention, BertSelfAttention) and layer.attention.head_size % 16 == 0
              and is_product(layer.attention.qkv)]
    for layer in layers:
        layer.attention = KernelSelfAttention(layer.attention)
    return len(layers)
