from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from specserve.models import llama
from specserve.models.config import ModelConfig
from specserve.models.loader import iter_checkpoint, load_weights

logger = logging.getLogger(__name__)

# config.architectures[0] -> model class
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": llama.LlamaForCausalLM,
    "Qwen2ForCausalLM": llama.Qwen2ForCausalLM,
    "Qwen3ForCausalLM": llama.Qwen3ForCausalLM,
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def model_class(config: ModelConfig) -> type[nn.Module]:
    arch = config.architectures[0] if config.architectures else None
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[arch]


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               config: ModelConfig | None = None, weights=None) -> nn.Module:
    """`weights`: (name, tensor) pairs to load instead of the whole checkpoint (a tensor-parallel shard's)."""
    config = config or ModelConfig.from_pretrained(model_dir)
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=device)
    # buffers (rotary tables) are not in the checkpoint: rebuild them on the real device
    model.rotary = type(model.rotary)(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling).to(device)
    num_main = config.num_hidden_layers

    def keep(name: str) -> str | None:
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= num_main:   # MTP layers: loaded by the MTP drafter
                return None
        if name == "lm_head.weight" and config.tie_word_embeddings:
            return None
        return name

    unused = load_weights(model, weights if weights is not None else iter_checkpoint(model_dir), llama.PACKED, prefix_map=keep)
    if unused:
        logger.info("ignored %d checkpoint tensors (e.g. %s)", len(unused), unused[0])
    model = model.to(dtype).eval().requires_grad_(False)
    model.rotary.to(torch.float32)
    return model
