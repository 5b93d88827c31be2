"""Multi-token prediction (MTP) layers in the DeepSeek-V3 layout, over a Llama/Qwen3 target.

Checkpoint: config.json has num_nextn_predict_layers = N; for an L-layer target, model.layers.{L+i}.*
(i < N) hold enorm, hnorm, eh_proj, a decoder layer of the target's kind (self_attn.*, mlp.*,
input_layernorm, post_attention_layernorm) and optionally shared_head.norm / shared_head.head (absent:
the target's final norm and lm_head). The embed_tokens copy DeepSeek stores per layer is ignored: the
target's embedding is shared.

Slots: layer d's entry at slot s (rotary position s) reads token s and the hidden state the layer
before it (the target, for d = 0) produced at slot s - 1; its output, like the target's hidden state
at s, predicts token s + 1. An entry thus depends on tokens[:s + 1] only, so a prefix-cache block is
as valid for the MTP caches as for the target's. Slot 0 has nothing before it: its inputs are zero.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from specserve.models import llama
from specserve.models.config import ModelConfig
from specserve.models.llama import DecoderLayer, RMSNorm
from specserve.models.loader import checkpoint_files, load_weights, save_safetensors, unpacked_state_dict
from specserve.layers.attention import ForwardContext
from specserve.layers.rotary import RotaryEmbedding

#: config.architectures[0] of a folder that holds only MTP layers (not a causal LM of its own)
MTP_ARCHITECTURE = "MultiTokenPredictor"
MTP_FILE = "model-mtp.safetensors"
CONFIG_FIELDS_SHARED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "vocab_size", "intermediate_size")


class SharedHead(nn.Module):
    """An MTP layer's own output norm and/or head; a missing one is the target's."""

    def __init__(self, config: ModelConfig, own_norm: bool, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if own_norm else None
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None


class MTPLayer(DecoderLayer):
    """A decoder layer fed eh_proj([enorm(embedding); hnorm(hidden)]). It subclasses DecoderLayer so that
    its parameters carry the checkpoint's names."""

    def __init__(self, config: ModelConfig, index: int, own_norm: bool = False, own_head: bool = False):
        super().__init__(config, index)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config, own_norm, own_head) if own_norm or own_head else None

    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


class MultiTokenPredictor(nn.Module):
    def __init__(self, config: ModelConfig, num_layers: int, own_norm: list[bool] | None = None,
                 own_head: list[bool] | None = None):
        super().__init__()
        own_norm = own_norm or [False] * num_layers
        own_head = own_head or [False] * num_layers
        self.config = config
        self.layers = nn.ModuleList(MTPLayer(config, i, own_norm[i], own_head[i]) for i in range(num_layers))
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, layer: int, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext | None = None) -> torch.Tensor:
        """embeds/hidden [N, H] with a paged ctx, or [B, T, H] for cache-free training; hidden[s] is the
        previous layer's output at slot s - 1. Returns the layer's output before the output norm."""
        m = self.layers[layer]
        cos, sin = self.rotary.lookup(positions, embeds.dtype)
        return m(m.combine(embeds, hidden), cos, sin, ctx)

    def compute_logits(self, layer: int, hidden: torch.Tensor, target: nn.Module, head=None) -> torch.Tensor:
        """Layer `layer`'s logits: its own head, else the target's, unless `head` (a reduced one) replaces it."""
        own = self.layers[layer].shared_head
        norm = own.norm if own is not None and own.norm is not None else target.model.norm
        if head is not None:
            return head(norm(hidden))
        if own is not None and own.head is not None:
            return own.head(norm(hidden))
        return target.compute_logits(norm(hidden))

    def head_weight(self, layer: int, target: nn.Module) -> torch.Tensor | None:
        """The [V, H] weight of layer `layer`'s head while it is still a tensor: its own (before packing), else
        the target's tied embedding; None when only a packed kernel holds it."""
        own = self.layers[layer].shared_head
        if own is not None and own.head is not None:
            return getattr(own.head, "weight", None)
        weight = getattr(target.model.embed_tokens, "weight", None)     # a sharded target holds a vocabulary slice
        return weight if target.config.tie_word_embeddings and weight is not None \
            and weight.shape[0] == target.config.vocab_size else None


def shift_right(hidden: torch.Tensor) -> torch.Tensor:
    """[B, T, H] -> the same with slot s holding slot s - 1 (zero at slot 0): what the next layer reads."""
    return F.pad(hidden, (0, 0, 1, 0))[:, :-1]


# ---- checkpoints -----------------------------------------------------------------------------
def _layer_of(name: str, first: int, count: int | None = None) -> int | None:
    """i for a tensor of model.layers.{first + i} with 0 <= i < count (any i >= 0 without count), else None."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        i = int(parts[2]) - first
        return i if i >= 0 and (count is None or i < count) else None
    return None


def _tensor_names(model_dir: str | Path) -> list[str]:
    names = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def iter_mtp_tensors(model_dir: str | Path, first: int, count: int):
    """(name, tensor) of model.layers.{first..first+count-1}.*, reading no other tensor."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if _layer_of(name, first, count) is not None:
                    yield name, f.get_tensor(name)


def check_compatible(mtp_config: ModelConfig, target_config: ModelConfig, where: str | Path) -> None:
    for name in CONFIG_FIELDS_SHARED:
        if getattr(mtp_config, name) != getattr(target_config, name):
            raise ValueError(f"the MTP layers in {where} do not fit the target: {name} is "
                             f"{getattr(mtp_config, name)}, the target's {getattr(target_config, name)}")


def load_mtp(weights_dir: str | Path, target_config: ModelConfig, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> MultiTokenPredictor:
    """The MTP layers of a target checkpoint, or of a folder holding only them (its config.json carries
    num_nextn_predict_layers and the target's shape)."""
    folder_config = ModelConfig.from_pretrained(weights_dir)
    check_compatible(folder_config, target_config, weights_dir)
    L, N = target_config.num_hidden_layers, folder_config.num_nextn_predict_layers
    if N <= 0:
        raise ValueError(f"{weights_dir}/config.json declares no MTP layers (num_nextn_predict_layers)")
    names = {name for name in _tensor_names(weights_dir) if _layer_of(name, L, N) is not None}
    if not names:
        raise ValueError(f"{weights_dir} declares {N} MTP layers but holds no model.layers.{L}.* weights")
    own_norm = [f"model.layers.{L + i}.shared_head.norm.weight" in names for i in range(N)]
    own_head = [f"model.layers.{L + i}.shared_head.head.weight" in names for i in range(N)]
    model = MultiTokenPredictor(target_config, N, own_norm, own_head).to(device)

    def rename(name: str) -> str | None:
        i = _layer_of(name, L, N)
        rest = name.split(".", 3)[3]
        return None if rest.startswith("embed_tokens.") else f"layers.{i}.{rest}"

    unused = load_weights(model, iter_mtp_tensors(weights_dir, L, N), llama.PACKED, prefix_map=rename)
    if unused:
        raise ValueError(f"the MTP layers in {weights_dir} are not decoder layers of the target's kind: "
                         f"unexpected weights {unused[:4]}")
    model = model.to(dtype).eval().requires_grad_(False)
    model.rotary.to(torch.float32)
    return model


def mtp_state_dict(model: MultiTokenPredictor) -> dict[str, torch.Tensor]:
    """Parameters under DeepSeek-V3 names: layers.{i}.* -> model.layers.{L+i}.*."""
    L = model.config.num_hidden_layers
    out = {}
    for name, tensor in unpacked_state_dict(model, llama.PACKED).items():
        _, i, rest = name.split(".", 2)
        out[f"model.layers.{L + int(i)}.{rest}"] = tensor
    return out


def save_mtp_folder(model: MultiTokenPredictor, target_dir: str | Path, out_dir: str | Path, dtype: torch.dtype) -> None:
    """A folder holding only the MTP layers: the target's config.json with num_nextn_predict_layers and
    architectures [MTP_ARCHITECTURE] (so it is not mistaken for a draft model), and their weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(target_dir) / "config.json").read_text())
    config |= {"architectures": [MTP_ARCHITECTURE], "num_nextn_predict_layers": model.num_layers,
               "target_architectures": config.get("architectures")}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_safetensors(mtp_state_dict(model), out_dir / "model.safetensors", dtype)


def save_mtp_into_checkpoint(model: MultiTokenPredictor, target_dir: str | Path, dtype: torch.dtype) -> None:
    """Writes the layers into the target's own checkpoint and sets num_nextn_predict_layers in its config.
    Earlier MTP layers are replaced. A sharded checkpoint gets one more shard in its index; a single
    model.safetensors is rewritten with the layers added."""
    target_dir = Path(target_dir)
    config_path = target_dir / "config.json"
    config = json.loads(config_path.read_text())
    L = config["num_hidden_layers"]
    new = mtp_state_dict(model)
    index_path = target_dir / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if _layer_of(k, L) is None}
        save_safetensors(new, target_dir / MTP_FILE, dtype)
        index["weight_map"] |= {k: MTP_FILE for k in new}
        _write_atomic(index_path, json.dumps(index, indent=2) + "\n")
    else:
        [path] = checkpoint_files(target_dir)
        with safe_open(str(path), framework="pt") as f:
            merged = {k: f.get_tensor(k) for k in f.keys() if _layer_of(k, L) is None}
        tmp = path.with_suffix(".tmp")
        save_safetensors(merged | {k: v.to(dtype) for k, v in new.items()}, tmp)
        os.replace(tmp, path)
    config["num_nextn_predict_layers"] = model.num_layers
    _write_atomic(config_path, json.dumps(config, indent=2) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
