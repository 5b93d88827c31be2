"""Llama-family decoder (Llama 3.x, Qwen2, Qwen3): one implementation, differences come from the config.

Parameters use Hugging Face names except for two fused projections (qkv_proj, gate_up_proj);
PACKED maps the checkpoint's names onto their shards (see models/loader.py).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.attention import ForwardContext, causal_attention
from specserve.layers.linear import InferenceLinear
from specserve.layers.rotary import RotaryEmbedding, apply_rotary
from specserve.models.config import ModelConfig

# checkpoint name -> (fused parameter name, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's order: normalize in fp32, round to x's dtype, then scale. (F.rms_norm with the weight
    scales before rounding: in bf16 about one output in four differs from transformers.)"""
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm in one fused CPU kernel, for inference: [x, -x] has mean 0 and variance mean(x^2), so its
    LayerNorm normalizes x as RMSNorm does (in fp32, rounded once, then scaled: the same order). F.rms_norm is
    a composite of ~8 small ops on CPU; this is +7-13% tokens/s on small models. Under autocast layer_norm
    returns fp32, so training keeps rms_norm."""
    D = x.shape[-1]
    return F.layer_norm(torch.cat((x, -x), dim=-1), (2 * D,), None, None, eps)[..., :D] * weight


Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.norm: Norm = rms_norm                              # pack_for_inference: rms_norm_fused on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


Linear = Callable[[torch.Tensor], torch.Tensor]


def frozen_linear(module: nn.Module) -> Linear:
    """The module's product without nn.Module's call machinery (about 1.5 us a call, ~10% of a small model's
    decode step): a bound forward, or F.linear over the plain weight."""
    if isinstance(module, nn.Linear):
        return functools.partial(F.linear, weight=module.weight, bias=module.bias)
    if isinstance(module, InferenceLinear) and len(set(module.choice)) == 1:
        return module.by_bucket[0]                  # one kernel for every row count: call it directly
    return module.forward


@dataclass(slots=True)
class AttentionWeights:
    qkv: Linear
    o: Linear
    qk_norm: torch.Tensor | None            # [Hq + Hkv, D]: each q head's then each k head's norm weight
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    layer_idx: int
    norm: Norm


@dataclass(slots=True)
class LayerWeights:
    """What one decoder layer computes with. Built from the live modules at each call (training: autograd
    flows through them), or once for inference by pack_for_inference (frozen: packed products, the q/k norm
    weights already joined, the fused RMSNorm on CPU), so that the decode path makes no module calls."""
    attn: AttentionWeights
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    eps: float
    norm: Norm


def attention(x: torch.Tensor, w: AttentionWeights, cos: torch.Tensor, sin: torch.Tensor,
              ctx: ForwardContext | None) -> torch.Tensor:
    lead = x.shape[:-1]                                                              # [N] or [B, T]
    qkv = w.qkv(x).view(*lead, w.num_heads + 2 * w.num_kv_heads, w.head_dim)
    qk, v = qkv.split([w.num_heads + w.num_kv_heads, w.num_kv_heads], dim=-2)
    if w.qk_norm is not None:       # one norm over all q and k heads, then each head scaled by its own weight
        qk = w.norm(qk, w.qk_norm, w.eps)
    qk = apply_rotary(qk, cos, sin)                           # q and k heads rotated together: fewer small ops
    q, k = qk.split([w.num_heads, w.num_kv_heads], dim=-2)
    out = causal_attention(q, k, v) if ctx is None else ctx.attend(q, k, v, w.layer_idx)
    return w.o(out.reshape(*lead, w.num_heads * w.head_dim))


def mlp(x: torch.Tensor, gate_up: Linear, down: Linear) -> torch.Tensor:
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate) * up)


def decoder_layer(x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                  ctx: ForwardContext | None) -> torch.Tensor:
    x = x + attention(w.norm(x, w.input_norm, w.eps), w.attn, cos, sin, ctx)
    return x + mlp(w.norm(x, w.post_norm, w.eps), w.gate_up, w.down)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.shard_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.frozen: AttentionWeights | None = None             # set by pack_for_inference

    def weights(self, frozen: bool = False) -> AttentionWeights:
        qk_norm = None
        if self.qk_norm:
            qk_norm = torch.cat((self.q_norm.weight.expand(self.num_heads, -1),
                                 self.k_norm.weight.expand(self.num_kv_heads, -1)))
        link = frozen_linear if frozen else (lambda m: m)
        return AttentionWeights(link(self.qkv_proj), link(self.o_proj), qk_norm, self.num_heads,
                                self.num_kv_heads, self.head_dim, self.eps, self.layer_idx,
                                self.q_norm.norm if self.qk_norm else rms_norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext | None) -> torch.Tensor:
        return attention(x, self.frozen if self.frozen is not None else self.weights(), cos, sin, ctx)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp(x, self.gate_up_proj, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.frozen: LayerWeights | None = None                 # set by pack_for_inference

    def weights(self, frozen: bool = False) -> LayerWeights:
        link = frozen_linear if frozen else (lambda m: m)
        return LayerWeights(self.self_attn.weights(frozen), self.input_layernorm.weight,
                            self.post_attention_layernorm.weight, link(self.mlp.gate_up_proj),
                            link(self.mlp.down_proj), self.input_layernorm.eps,
                            self.input_layernorm.norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext | None) -> torch.Tensor:
        return decoder_layer(x, self.frozen if self.frozen is not None else self.weights(), cos, sin, ctx)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward() returns hidden states; compute_logits() projects only the rows that need logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.compiled: Callable | None = None        # pack(compile=True): paged forwards through models/compiled.py

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext | None = None,
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids/positions [N] with a paged ctx, or [B, T] for cache-free causal training.

        Returns the final hidden states after the last norm and, for each index i in aux_layers,
        the residual stream entering layer i (i == num_layers: the last layer's output, pre-norm).
        """
        if self.compiled is not None and ctx is not None:
            return self.compiled(input_ids, positions, ctx, aux_layers)
        # layer.forward, not layer(): nn.Module's call machinery costs ~1.5 us
        return self.run_layers(input_ids, positions, ctx, aux_layers, [layer.forward for layer in self.model.layers])

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext | None,
                   aux_layers: tuple[int, ...], layers: list[Callable]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """forward() through `layers`, each (x, cos, sin, ctx) -> x: the modules, or a compiled graph's bundles."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions, x.dtype)
        aux = []
        for i, layer in enumerate(layers):
            if i in aux_layers:
                aux.append(x)
            x = layer(x, cos, sin, ctx)
        if len(layers) in aux_layers:
            aux.append(x)
        return self.model.norm(x), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def pack(self, device: torch.device, dtype: torch.dtype, quantization: str | None = None,
             compile: bool = False) -> LlamaForCausalLM:
        """pack_for_inference; a tied head gets its own inference linear over the embedding (the biggest
        single product of a small-vocabulary-heavy model such as SmolLM2: its kernel matters most). compile:
        paged forwards then run as torch.compile graphs (models/compiled.py)."""
        from specserve.models.packing import pack_for_inference   # it builds on this module's layers
        tied = {"lm_head": (self.model.embed_tokens.weight, None)} if self.lm_head is None else None
        pack_for_inference(self, device, dtype, quantization, tied)
        if compile:
            from specserve.models.compiled import CompiledForward
            self.compiled = CompiledForward(self)
        return self


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        config.qk_norm = True
        super().__init__(config)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        config.attention_bias = True        # Qwen2 always has q/k/v biases; its config.json does not say so
        super().__init__(config)
