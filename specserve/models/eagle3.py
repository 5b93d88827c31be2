"""EAGLE3 draft head in the published layout (EAGLE, SpecForge, AngelSlim checkpoints).

One Llama decoder layer (`midlayer`) reads [input_layernorm(embed(token)), hidden_norm(hidden)]; its
q/k/v take 2 x hidden. `hidden` is fc(concat of three target layers' states) for a token the target
has computed, and the head's own pre-norm output for a token it drafted. Logits cover a draft
vocabulary; draft id i is target id i + d2t[i]. The token embedding is usually the target's.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.attention import ForwardContext
from specserve.layers.rotary import RotaryEmbedding, apply_rotary
from specserve.models.config import ModelConfig
from specserve.models.llama import MLP, PACKED, Attention, RMSNorm
from specserve.models.loader import iter_checkpoint, load_weights, save_safetensors, unpacked_state_dict

logger = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
TRAINING_ONLY = ("t2d",)


@dataclass(slots=True)
class Eagle3Config:
    layer: ModelConfig                     # sizes of the one decoder layer (a Llama config)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] | None        # as written by the tool that trained the head
    norm_before_residual: bool = False

    @property
    def states_width(self) -> int:
        """fc's input: the three target states a slot reads, side by side."""
        return 3 * self.target_hidden_size

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE3 heads with {d['num_hidden_layers']} layers are not supported (only 1)")
        layer = ModelConfig.from_dict(d)
        ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(layer=layer, draft_vocab_size=d.get("draft_vocab_size") or layer.vocab_size,
                   target_hidden_size=d.get("target_hidden_size") or layer.hidden_size,
                   aux_layer_ids=list(ids) if ids else None,
                   norm_before_residual=bool(d.get("norm_before_residual", False)))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Eagle3Config:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    return (2, num_target_layers // 2, num_target_layers - 3)


def resolve_aux_layers(ids: list[int] | None, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose INPUT residual stream the head reads (what LlamaForCausalLM's aux_layers returns).

    Without ids: the EAGLE3 default, the states entering layers 2, L//2 and L-3 (EAGLE's reference,
    vLLM and SGLang all capture before those layers). With ids, the tools disagree on what an id
    means: SpecForge (and NeMo, TensorRT-LLM) write [1, L//2-1, L-4], meaning the OUTPUT of those
    layers, which SGLang reads by adding 1; others write the capture-before indices directly. As
    SGLang does since sgl-project/sglang#25454, a list starting at 1 is read as layer outputs (+1),
    any other list as layer inputs. Both readings give the default for a default head.
    """
    if ids is None:
        layers = default_aux_layers(num_target_layers)
    elif ids[0] == 1:
        layers = tuple(i + 1 for i in ids)
    else:
        layers = tuple(ids)
    if len(layers) != 3 or not all(0 <= i <= num_target_layers for i in layers):
        raise ValueError(f"EAGLE3 head reads target layers {list(layers)} (from ids {ids}), but the target has "
                         f"{num_target_layers} layers: a head needs three layers in [0, {num_target_layers}]")
    return layers


class Eagle3Attention(Attention):
    """Llama attention whose q/k/v read the 2 x hidden concatenation [embedding, hidden state]."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, layer_idx=0)
        self.qkv_proj = nn.Linear(2 * config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)

    def forward_unrolled(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test, x [B, T, 2H]: unrolled step s = len(earlier) at position i stands for the
        draft made s tokens after the context ending at i. It sees step 0's keys at positions <= i
        (the target-fed context) and its own chain: steps 1..s at position i. Returns (out, this step's k/v)."""
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.shard_sizes, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys = torch.cat([e[0] for e in earlier] + [k], dim=1).transpose(1, 2)              # [B, Hkv, (s+1)T, D]
        values = torch.cat([e[1] for e in earlier] + [v], dim=1).transpose(1, 2)
        eye = torch.eye(T, dtype=torch.bool, device=x.device)
        mask = torch.cat([torch.ones(T, T, dtype=torch.bool, device=x.device).tril()] + [eye] * len(earlier), dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.q_size)), (k, v)


class Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig, norm_before_residual: bool):
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def _attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext | None) -> torch.Tensor:
        x, residual = self._attention_input(embeds, hidden)
        return self._mlp(residual + self.self_attn(x, cos, sin, ctx))

    def forward_unrolled(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        x, residual = self._attention_input(embeds, hidden)
        out, kv = self.self_attn.forward_unrolled(x, cos, sin, earlier)
        return self._mlp(residual + out), kv


class Eagle3Head(nn.Module):
    """forward() returns the pre-norm hidden state (fed back for the next draft step);
    draft_logits() turns it into logits over the draft vocabulary."""

    def __init__(self, config: Eagle3Config, max_positions: int, embed_tokens: nn.Embedding | None = None):
        super().__init__()
        c = config.layer
        self.config = config
        self.embed_tokens = embed_tokens       # usually the target's own module, attached after loading
        self.fc = nn.Linear(config.states_width, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c, config.norm_before_residual)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.rotary = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext | None = None) -> torch.Tensor:
        """input_ids/positions [N] with a paged ctx (or [B, T] / [T] without), hidden [..., H] -> [..., H]."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary.lookup(positions, hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, ctx)

    def forward_unrolled(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                         earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test step len(earlier), input_ids [B, T], hidden [B, T, H]: see Eagle3Attention."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary.lookup(positions, hidden.dtype)
        return self.midlayer.forward_unrolled(embeds, hidden, cos, sin, earlier)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def check_fits_target(config: Eagle3Config, target: ModelConfig, path: str | Path) -> None:
    """Start-up errors that name the mismatch between a head and the target it is meant for."""
    c = config.layer
    problems = []
    if config.target_hidden_size != target.hidden_size:
        problems.append(f"it reads target hidden states of size {config.target_hidden_size}, the target's are {target.hidden_size}")
    if c.vocab_size != target.vocab_size:
        problems.append(f"its vocab_size is {c.vocab_size}, the target's is {target.vocab_size}")
    if config.draft_vocab_size > target.vocab_size:
        problems.append(f"its draft vocabulary ({config.draft_vocab_size}) is larger than the target's ({target.vocab_size})")
    if problems:
        raise ValueError(f"the EAGLE3 head in {path} does not fit the target: " + "; ".join(problems))


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a head: safetensors, or pytorch_model.bin as the EAGLE reference ships it."""
    if (path / "pytorch_model.bin").exists() and not list(path.glob("*.safetensors")):
        weights = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        weights = dict(iter_checkpoint(path))
    # some exporters name the decoder layer like a model's first layer
    return {name.removeprefix("model.").replace("layers.0.", "midlayer."): t for name, t in weights.items()}


def load_eagle3_head(path: str | Path, target_embed: nn.Embedding, target: ModelConfig, dtype: torch.dtype,
                     device: torch.device | str, max_positions: int) -> Eagle3Head:
    path = Path(path)
    config = Eagle3Config.from_pretrained(path)
    check_fits_target(config, target, path)
    weights = _checkpoint_tensors(path)
    d2t = weights.pop("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64)).long()
    for name in TRAINING_ONLY:
        weights.pop(name, None)
    own_embed = weights.pop("embed_tokens.weight", None)
    if own_embed is None and target_embed.embedding_dim != config.layer.hidden_size:
        raise ValueError(f"the EAGLE3 head in {path} has hidden size {config.layer.hidden_size} and no embed_tokens, "
                         f"so it needs the target's embedding, whose size is {target_embed.embedding_dim}")
    mapped = d2t + torch.arange(len(d2t))
    if len(d2t) != config.draft_vocab_size or int(mapped.min()) < 0 or int(mapped.max()) >= target.vocab_size:
        raise ValueError(f"the EAGLE3 head in {path} has a d2t of {len(d2t)} entries mapping into [{int(mapped.min())}, "
                         f"{int(mapped.max())}]; expected {config.draft_vocab_size} entries inside the target's "
                         f"{target.vocab_size} tokens")
    with torch.device("meta"):
        head = Eagle3Head(config, max_positions)
    head = head.to_empty(device=device)
    head.rotary = RotaryEmbedding(config.layer.head_dim, max_positions, config.layer.rope_theta,
                                  config.layer.rope_scaling).to(device)
    unused = load_weights(head, weights.items(), PACKED)
    if unused:
        logger.warning("the EAGLE3 head in %s has tensors specserve does not use: %s", path, unused[:8])
    with torch.no_grad():
        head.d2t.copy_(d2t)
    head = head.to(dtype).eval().requires_grad_(False)
    head.rotary.to(torch.float32)
    if own_embed is None:
        head.embed_tokens = target_embed
    else:
        head.embed_tokens = nn.Embedding.from_pretrained(own_embed.to(device, dtype), freeze=True)
    return head


def eagle3_config_dict(config: Eagle3Config, dtype: torch.dtype) -> dict:
    """config.json in the published layout."""
    c = config.layer
    d = {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size, "tie_word_embeddings": False, "attention_bias": c.attention_bias,
        "norm_before_residual": config.norm_before_residual, "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if config.aux_layer_ids is not None:
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids), "use_aux_hidden_state": True}
    return d


def save_eagle3_head(head: Eagle3Head, out_dir: str | Path, dtype: torch.dtype, t2d: torch.Tensor | None = None) -> None:
    """config.json and model.safetensors in the published layout (no embed_tokens: the target's is shared)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(eagle3_config_dict(head.config, dtype), indent=2) + "\n")
    state = {k: v for k, v in unpacked_state_dict(head, PACKED).items() if not k.startswith("embed_tokens.")}
    state["d2t"] = head.d2t.detach().cpu()
    if t2d is not None:
        state["t2d"] = t2d.bool().cpu()
    save_safetensors(state, out_dir / "model.safetensors", dtype)
