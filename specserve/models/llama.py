"""Llama-family decoder (Llama 3.x, Qwen2, Qwen3): one implementation, differences come from the config.

Parameters use Hugging Face names except for two fused projections (qkv_proj, gate_up_proj);
PACKED maps the checkpoint's names onto their shards (see models/loader.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.attention import ForwardContext, causal_attention, paged_attention
from specserve.layers.linear import PackedLinear, can_pack, pack_linears, worth_packing
from specserve.layers.rotary import RotaryEmbedding, apply_rotary
from specserve.models.config import ModelConfig

# checkpoint name -> (fused parameter name, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.shard_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext | None) -> torch.Tensor:
        lead = x.shape[:-1]                                                          # [N] or [B, T]
        qkv = self.qkv_proj(x).view(*lead, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=-2)
        if self.qk_norm:    # one norm over all q and k heads, then each head scaled by its own weight
            weight = torch.cat((self.q_norm.weight.expand(self.num_heads, -1),
                                self.k_norm.weight.expand(self.num_kv_heads, -1)))       # [Hq + Hkv, D]
            qk = F.rms_norm(qk, (self.head_dim,), None, self.q_norm.eps) * weight
        qk = apply_rotary(qk, cos, sin)                       # q and k heads rotated together: fewer small ops
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=-2)
        if ctx is None:
            out = causal_attention(q, k, v)
        else:
            out = paged_attention(q, k, v, ctx, self.layer_idx)
        return self.o_proj(out.reshape(*lead, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext | None = None,
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids/positions [N] with a paged ctx, or [B, T] for cache-free causal training.

        Returns the final hidden states after the last norm and, for each index i in aux_layers,
        the residual stream entering layer i (i == num_layers: the last layer's output, pre-norm).
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions, x.dtype)
        aux = []
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                aux.append(x)
            x = layer(x, cos, sin, ctx)
        if len(self.model.layers) in aux_layers:
            aux.append(x)
        return self.model.norm(x), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def pack(self, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
        """For inference: packed linears (layers/linear.py); a tied head gets its own packed copy."""
        if self.lm_head is None and can_pack(device, dtype) and worth_packing(self.model.embed_tokens.weight):
            self.lm_head = PackedLinear(self.model.embed_tokens.weight, None)
        return pack_linears(self, device, dtype)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        config.qk_norm = True
        super().__init__(config)

