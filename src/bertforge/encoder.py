"""The BERT encoder (Devlin et al. 2018), one module per concept of the paper.

Shapes: B batch, T tokens, H hidden size, N attention heads, D head size (H / N), I intermediate size.
Conventions: `attention_mask` is 1 for real tokens and 0 for padding; `token_type_ids` are 0 for segment A
and 1 for segment B; padding may sit anywhere but is usually on the right.

Differences from the Hugging Face module tree, for speed: query, key and value are one (3H, H) projection,
and the feed-forward and normalisation modules sit directly on the layer. `model_files.py` holds the one
name map between the two layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.attention
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from bertforge.add_norm import add_norm
from bertforge.config import BertConfig
from bertforge.dropout import Dropout, dropout
from bertforge.gelu import gelu, linear_gelu
from bertforge.linear import Linear
from bertforge.model_files import load_pretrained, save_pretrained
from bertforge.training_attention import TrainingAttention, TrainingPacking, VarlenAttention

CLS_INDEX = 0  # the tokenizer puts [CLS] first in every sequence: token 0 is what the pooler reads


def activation(name: str):
    if name == "gelu":
        return gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"unknown activation {name!r}")


class BertEmbeddings(nn.Module):
    """Token + segment + position embeddings, summed, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        T = input_ids.shape[-1]
        x = self.word_embeddings(input_ids) + self.position_embeddings.weight[:T]  # (B, T, H)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product attention over the whole sequence, with the padding mask."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size)  # rows: query, key, value
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None = None,
                packing: TrainingPacking | None = None) -> torch.Tensor:
        """x (B, T, H); mask (B, 1, 1, T) bool, True where attending is allowed, or None.
        positions (B, P): only these positions query (keys and values still come from every position), and
        the output is (B, P, H) in their order. packing: x is the batch's real tokens (rows, H) (`TrainingPacking`),
        the output (rows, H); only on the CPU kernels or CUDA's flash attention (`BertModel` packs only where
        `TrainingAttention.applies` or `VarlenAttention.applies`)."""
        qkv = self.qkv(x)  # (B, T, 3H), or (rows, 3H) packed
        p = self.dropout_p if self.training else 0.0
        if packing is not None and qkv.is_cuda:
            return VarlenAttention.apply(qkv, self.num_heads, packing, p)
        if packing is not None:
            return TrainingAttention.apply(qkv, self.num_heads, None, p, packing)
        B, T, _ = x.shape
        if positions is None and TrainingAttention.takes(qkv, mask, self.head_size, p):
            return TrainingAttention.apply(qkv, self.num_heads, None if mask is None else mask.reshape(B, T), p)
        qkv = qkv.view(B, T, 3, self.num_heads, self.head_size)  # (B, T, 3, N, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, N, T, D)
        if positions is not None:
            q = q.gather(2, positions[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))  # (B, N, P, D)
        y = attend(q, k, v, mask, p)  # (B, N, T or P, D)
        return y.transpose(1, 2).reshape(B, q.shape[2], -1)  # (B, T or P, H)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
           ) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over the keys `mask` allows, on whichever kernel is faster for these inputs (the
    explicit one or SDPA, below). q (B, N, P, D), k and v (B, N, T, D), mask (B, 1, 1, T) bool or None; (B, N, P, D)."""
    if _explicit_attention_is_faster(q, k.shape[2], dropout_p):
        return _explicit_attention(q, k, v, mask, dropout_p)
    if mask is not None and q.is_cuda and CUDA_MASKED_BACKENDS is not None:
        with torch.nn.attention.sdpa_kernel(CUDA_MASKED_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


# On CUDA a padded batch's mask rules flash attention out, and torch (2.11) then picks cuDNN's kernel, which plans
# each new shape for ~8 ms a layer on the host: over 40 batches of new widths (BERT-base, bf16, H200, `predict`'s
# sorted batches) 73k tokens/s, against 653k kept off it (8.9x), and 0.94M against 1.11M once every width was seen;
# fine-tuning steps 46k against 114k first (2.5x), even after. So masked attention on CUDA takes the
# memory-efficient kernel (bench/gpu_check_shapes.py; docs/benchmarks.md). None leaves the choice to torch.
CUDA_MASKED_BACKENDS: list[SDPBackend] | None = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                 SDPBackend.MATH]


# Training under bf16/fp16 autocast on a CPU, PyTorch's fused attention kernel (flash for CPU) is 2-4x slower
# at short sequences than two batched matmuls and a softmax, mostly in its backward (torch 2.13, AVX512-BF16,
# heads of 64: 12.7 against 3.7 ms a layer at B 32, T 64, 4 heads; even at T 192; worse from T 256 on, where its
# blocking pays and the (T, T) scores grow). In bf16 inference (forward only, freed memory kept as the commands
# run) the explicit kernel is ahead up to 128 keys (heads of 32, 1,792 tokens a call, no mask: 0.80 against 1.98
# ms at 16 keys, 1.51 against 2.38 at 64, 3.20 against 3.69 at 128) and even at 192; end to end it made bf16 predict
# 1.03-1.04x faster (once 0.99x), with the same accuracy. fp32 without dropout keeps the fused kernel: there it is
# as fast or faster from 32 keys on. See bench/attention.py.
_EXPLICIT_ATTENTION_MAX_T = 192
_EXPLICIT_INFERENCE_MAX_T = 128


def _explicit_attention_is_faster(q: torch.Tensor, keys: int, dropout_p: float) -> bool:
    if q.device.type != "cpu":
        return False
    if dropout_p > 0:  # SDPA's CPU path with dropout is its unfused math path anyway, with torch's slow masks
        return True  # (`bertforge.dropout`)
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    return keys <= (_EXPLICIT_ATTENTION_MAX_T if q.requires_grad else _EXPLICIT_INFERENCE_MAX_T)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        dropout_p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v with the same inputs and result as `F.scaled_dot_product_attention`;
    q (B, N, P, D), k and v (B, N, T, D), mask (B, 1, 1, T) bool or None; the softmax in at least fp32."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, N, P, T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    if dropout_p > 0:
        probs = dropout(probs, dropout_p)
    return probs @ v  # (B, N, P, D)


class BertLayer(nn.Module):
    """Post-LN Transformer encoder layer: x = LN(x + Attn(x)); x = LN(x + FFN(x)).
    With `config.pre_layer_norm`: x = x + Attn(LN(x)); x = x + FFN(LN(x)) (the encoder adds a final LN)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.pre_ln = config.pre_layer_norm
        H, inner = config.hidden_size, config.intermediate_size
        self.attention = BertSelfAttention(config)
        self.attention_out = Linear(H, H)
        self.attention_norm = nn.LayerNorm(H, eps=config.layer_norm_eps)
        self.intermediate = Linear(H, inner)
        self.act = activation(config.hidden_act)
        self.output = Linear(inner, H)
        self.output_norm = nn.LayerNorm(H, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None = None,
                packing: TrainingPacking | None = None) -> torch.Tensor:
        """positions (B, P): compute the output at these positions only, (B, P, H) (see `BertModel.forward`).
        packing: x holds the real tokens only, (rows, H), as the output does."""
        y = self.attention(self.attention_norm(x) if self.pre_ln else x, mask, positions, packing)
        if positions is not None:
            x = x.gather(1, positions[..., None].expand(-1, -1, x.shape[2]))
        if self.pre_ln:
            x = x + self.dropout(self.attention_out(y))
            return x + self.dropout(self.output(self.act(self.intermediate(self.output_norm(x)))))
        x = add_norm(self.attention_out, y, x, self.attention_norm, self.dropout)  # LN(x + dropout(out(y)))
        x = add_norm(self.output, linear_gelu(self.intermediate, x, self.act), x, self.output_norm, self.dropout)
        return x  # (B, T, H), or (B, P, H)


class BertEncoder(nn.Module):
    compiled = False  # compile_encoder sets it

    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        # Pre-LN layers leave their residual stream unnormalised: one LayerNorm after the last.
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.pre_layer_norm \
            else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None = None,
                packing: TrainingPacking | None = None) -> torch.Tensor:
        """positions (B, P): the last layer computes these positions only. packing: x is the batch's real tokens
        (rows, H), which the layers run on; with positions the last runs on the padded batch again, at those, and
        without, the output is the padded batch's (B, T, H), zeros at the padding."""
        last = len(self.layer) - 1
        for i, layer in enumerate(self.layer):
            if packing is not None and i == last and positions is not None:
                x, packing = packing.unpack(x), None
            x = layer(x, mask, positions if i == last else None, packing)
        x = self.final_norm(x) if self.final_norm is not None else x
        return x if packing is None else packing.unpack(x)


class BertPooler(nn.Module):
    """tanh(dense(h_[CLS])): the sentence representation the NSP and classification heads read."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)

    def forward(self, sequence_output: torch.Tensor, cls_index: int) -> torch.Tensor:
        """sequence_output (B, T, H); cls_index: where [CLS] sits along T."""
        return torch.tanh(self.dense(sequence_output[:, cls_index]))  # (B, H)


@dataclass
class EncoderOutput:
    sequence_output: torch.Tensor  # (B, T, H) last layer, every position; (B, P, H) with positions=
    pooled_output: torch.Tensor | None  # (B, H) pooler over [CLS]; None without a pooler or cls_column


def attention_mask_for_sdpa(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) 1/0 padding mask -> (B, 1, 1, T) bool mask for SDPA, or None when nothing is padded.

    A mask with no padding is dropped so SDPA can take its unmasked fast path (the fused kernels). Only a mask
    in host memory is looked at: reading a GPU tensor's values would make the host wait for the GPU on every
    forward pass. So a caller on CUDA that wants the fast path keeps a padding-free mask on the host, as the
    training loop does (device.py `to_device`); a mask on the GPU is passed on as it is, which is correct.
    """
    if attention_mask is None:
        return None
    if attention_mask.device.type == "cpu":
        # looked at in numpy where it can be: 2 us, against 12 in torch for one text
        numpy = attention_mask.dtype in _NUMPY_MASKS and not attention_mask.requires_grad
        values = attention_mask.numpy() if numpy else attention_mask.bool()
        if values.all():
            return None
    return attention_mask.bool()[:, None, None, :]


_NUMPY_MASKS = (torch.int64, torch.int32, torch.bool, torch.float32)


class BertPreTrainedModel(nn.Module):
    """Weight init, `from_pretrained` and `save_pretrained` for every model class."""

    config: BertConfig
    looks_up_words = False  # True for task models: nothing but the lookups reads their word embedding

    def init_weights(self) -> None:
        self.apply(self._init_module)

    def set_dropout(self, p: float) -> None:
        """Use dropout probability `p` everywhere (e.g. 0 for budget pretraining), leaving `config` as it is, so
        a saved model keeps the configured dropout for fine-tuning."""
        for module in self.modules():
            if isinstance(module, nn.Dropout):
                module.p = p
            elif isinstance(module, BertSelfAttention):
                module.dropout_p = p

    def looked_up_embeddings(self) -> list[nn.Embedding]:
        """The embeddings that training reads only by looking rows up (bertforge.train.rows): a task model's word
        embedding; none where a head reads the whole matrix (pretraining's masked-LM decoder, tied to it)."""
        return [self.bert.embeddings.word_embeddings] if self.looks_up_words else []

    def compile_encoder(self) -> None:
        """torch.compile the encoder layers in place (where the time goes), with dynamic batch, length and
        position counts, so batches of any shape reuse one graph (one more for a batch without padding, one for
        evaluation). The embeddings, the mask and the heads stay eager: they read values that set shapes (the
        masked positions, whether anything is padded), which would break the graph or recompile every step.
        Eager behaviour is unchanged when this is not called; `state_dict` keys are unchanged when it is."""
        for module in self.modules():
            if isinstance(module, BertEncoder):
                module.compile(dynamic=True)
                module.compiled = True

    def _init_module(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    @classmethod
    def from_pretrained(cls, path, *, config: BertConfig | None = None, verbose: bool = True, **overrides):
        """Load a model directory (ours, Hugging Face's, or a Google-converted one). Keyword arguments
        override config fields (e.g. `num_labels=3`). Missing task or pretraining heads are initialised
        and reported; any other missing, unexpected or mis-shaped weight raises a BertforgeError."""
        return load_pretrained(cls, path, config=config, verbose=verbose, **overrides)

    def save_pretrained(self, path) -> None:
        """Write `config.json` and `model.safetensors` with Hugging Face names, atomically."""
        save_pretrained(self, path)


class BertModel(BertPreTrainedModel):
    """The encoder: embeddings, L encoder layers, and (optionally) the pooler."""

    hf_architecture = "BertModel"

    def __init__(self, config: BertConfig, *, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.init_weights()

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *, cls_only: bool = False,
                positions: torch.Tensor | None = None, cls_column: int | None = None,
                reads_padding: bool = True) -> EncoderOutput:
        """input_ids (B, T); token_type_ids (B, T) or None (all segment A); attention_mask (B, T) 1 = real.

        positions (B, P): the last layer is computed at these positions only, and sequence_output is (B, P, H)
        in their order: the same values for most of a layer's work less, when a head reads only some
        positions. cls_column: the column of positions that holds [CLS] (CLS_INDEX), which the pooler reads;
        with positions and no cls_column the pooler does not run. cls_only: [CLS] only, positions
        [[CLS_INDEX]] * B. reads_padding False: the caller reads no padded position of sequence_output (a tagger
        whose labels ignore the padding), so training may run every layer on the real tokens alone (`_packs`),
        sequence_output then zeros at the padding."""
        if input_ids.shape[-1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {input_ids.shape[-1]} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}; truncate the input")
        x = self.embeddings(input_ids, token_type_ids)
        if cls_only:
            positions = torch.full((input_ids.shape[0], 1), CLS_INDEX, dtype=torch.long, device=input_ids.device)
            cls_column = 0
        mask = attention_mask_for_sdpa(attention_mask)
        if self._packs(x, mask, positions, reads_padding):
            packing = TrainingPacking.of(attention_mask)
            x = self.encoder(packing.pack(x), mask, positions, packing)
        else:
            x = self.encoder(x, mask, positions)  # or inference's encoder in its place (bertforge.infer)
        cls_index = CLS_INDEX if positions is None else cls_column
        pooled = self.pooler(x, cls_index) if self.pooler is not None and cls_index is not None else None
        return EncoderOutput(sequence_output=x, pooled_output=pooled)

    def _packs(self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None,
               reads_padding: bool) -> bool:
        """Whether layers train on the batch's real tokens alone (`TrainingPacking`): training with padding,
        attention on the CPU kernels (fp32 or bf16 autocast) or on CUDA's flash attention (bf16 or fp16 autocast),
        and a head that reads only some positions (the layers before the last, where there is more than one: the
        last runs on the padded batch at those) or no padded position (every layer)."""
        config = self.config
        head = (positions is not None and config.num_hidden_layers > 1) or (positions is None and not reads_padding)
        if not (TrainingPacking.enabled and head and self.training and torch.is_grad_enabled() and mask is not None
                and isinstance(self.encoder, BertEncoder) and not self.encoder.compiled):
            return False
        if x.device.type == "cuda":
            return VarlenAttention.applies(x, config.head_size)
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") != torch.bfloat16:
            return False  # the products' outputs fp16: attention off the kernels, so on the padded batch
        B, T = x.shape[:2]
        p = max(layer.attention.dropout_p for layer in self.encoder.layer)  # as set_dropout may have set it
        return TrainingAttention.applies(x, config.head_size, p, B * config.num_attention_heads * T * T)
