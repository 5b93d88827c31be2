"""Demo model sizes, from-scratch initialisation and export in the Hugging Face Qwen3 layout."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specserve.models import llama
from specserve.models.config import ModelConfig
from specserve.models.loader import save_safetensors, unpacked_state_dict
from specserve.train.tokenizer import ENDOFTEXT, IM_END, SPECIAL_TOKENS

BOS_ID, EOS_IDS = SPECIAL_TOKENS.index(ENDOFTEXT), [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)]
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(slots=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 64


def hf_config(size: ModelSize, vocab_size: int, max_positions: int, dtype: torch.dtype) -> dict:
    """A config.json that both specserve and transformers' Qwen3ForCausalLM load."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": size.num_layers,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_IDS[0],
        "pad_token_id": BOS_ID,
        "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def build_model(config: dict, seed: int) -> llama.Qwen3ForCausalLM:
    """A freshly initialised model: GPT-2 style normal(0.02) weights, residual outputs scaled by depth."""
    torch.manual_seed(seed)
    model = llama.Qwen3ForCausalLM(ModelConfig.from_dict(config))
    residual_std = 0.02 / math.sqrt(2 * config["num_hidden_layers"])
    for name, param in model.named_parameters():
        if param.dim() == 1:
            continue                                       # norm weights stay 1
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        nn.init.normal_(param, std=std)
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_pretrained(model: nn.Module, config: dict, out_dir: Path, dtype: torch.dtype) -> None:
    """config.json, model.safetensors (Hugging Face names; the tied lm_head left out) and generation_config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": DTYPE_NAMES[dtype]}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_safetensors(unpacked_state_dict(model, llama.PACKED), out_dir / "model.safetensors", dtype)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_IDS, "pad_token_id": BOS_ID, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
