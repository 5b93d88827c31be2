"""A GGUF file (llama.cpp's format) read in Hugging Face terms: config.json fields and checkpoint tensors.

The `gguf` package (ggml's own reader) parses the file and dequantizes every tensor type it knows; this
module only renames. An architecture, tensor or setting it does not know is an error that names it,
never a silently different model.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """A GGUF file is known by its first four bytes, not by its name."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


@dataclass(frozen=True, slots=True)
class Architecture:
    hf_architecture: str        # config.json `architectures[0]`
    model_type: str
    permuted_qk: bool           # llama.cpp reorders Q/K rows for its interleaved rope (convert_hf_to_gguf `permute`)


# general.architecture -> how it maps onto a Hugging Face checkpoint
ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
MISSING = object()


def hf_tensor_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    raise ValueError(f"unsupported GGUF tensor {name!r} (llama, qwen2 and qwen3 decoder tensors are supported)")


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: within each head, GGUF interleaves the two rotary halves row by row
    (rows 0, D/2, 1, D/2+1, ...); Hugging Face keeps the first half, then the second. Works on weights and biases."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def f32_value(value: float) -> float:
    """A float32 setting as the short decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not is_gguf(self.path):
            raise ValueError(f"{self.path} is not a GGUF file")
        self.reader = gguf.GGUFReader(self.path)       # memory-mapped: tensors are read when dequantized
        self.arch_name = self.field("general.architecture")
        if self.arch_name not in ARCHITECTURES:
            raise ValueError(f"{self.path}: unsupported GGUF architecture {self.arch_name!r} "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        self.arch = ARCHITECTURES[self.arch_name]
        self.tensor_infos = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default=MISSING):
        f = self.reader.fields.get(key)
        if f is None:
            if default is MISSING:
                raise ValueError(f"{self.path}: GGUF metadata {key!r} is missing")
            return default
        return f.contents()

    def hparam(self, key: str, default=MISSING):
        return self.field(f"{self.arch_name}.{key}", default)

    def hf_config(self) -> dict:
        """config.json for the Hugging Face model this file holds."""
        heads = int(self.hparam("attention.head_count"))
        kv_heads = int(self.hparam("attention.head_count_kv", heads))
        hidden = int(self.hparam("embedding_length"))
        head_dim = int(self.hparam("attention.key_length", hidden // heads))
        if int(self.hparam("attention.value_length", head_dim)) != head_dim:
            raise ValueError(f"{self.path}: value heads of another width than key heads are not supported")
        if int(self.hparam("rope.dimension_count", head_dim)) != head_dim:
            raise ValueError(f"{self.path}: partial rotary embeddings (rope.dimension_count "
                             f"{self.hparam('rope.dimension_count')} of head_dim {head_dim}) are not supported")
        scaling = self.hparam("rope.scaling.type", "none")
        if scaling != "none" or "rope_freqs.weight" in self.tensor_infos:
            raise ValueError(f"{self.path}: rope scaling {scaling if scaling != 'none' else 'rope_freqs (Llama 3.1)'!r}"
                             " is not supported")
        embed = self.tensor_infos["token_embd.weight"]
        config = {
            "architectures": [self.arch.hf_architecture],
            "model_type": self.arch.model_type,
            "vocab_size": int(embed.shape[1]),                  # ggml shapes are [columns, rows]
            "hidden_size": hidden,
            "intermediate_size": int(self.hparam("feed_forward_length")),
            "num_hidden_layers": int(self.hparam("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": f32_value(self.hparam("attention.layer_norm_rms_epsilon")),
            "rope_theta": f32_value(self.hparam("rope.freq_base", 10000.0)),    # llama.cpp's default
            "max_position_embeddings": int(self.hparam("context_length")),
            "tie_word_embeddings": "output.weight" not in self.tensor_infos,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_infos,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id", None),
        }
        if self.arch_name == "qwen2":
            config["use_sliding_window"] = False
        return config

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every tensor in the file."""
        heads = int(self.hparam("attention.head_count"))
        kv_heads = int(self.hparam("attention.head_count_kv", heads))
        for t in self.reader.tensors:
            name = hf_tensor_name(t.name)
            try:
                values = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ValueError(f"{self.path}: tensor {t.name} has type {t.tensor_type.name}, which gguf.quants "
                                 "cannot dequantize") from None
            shape = tuple(int(d) for d in reversed(t.shape))
            tensor = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)    # a copy: F32 data is the mmap
            if self.arch.permuted_qk and ".attn_q." in t.name:
                tensor = unpermute_rows(tensor, heads)
            elif self.arch.permuted_qk and ".attn_k." in t.name:
                tensor = unpermute_rows(tensor, kv_heads)
            yield name, tensor
