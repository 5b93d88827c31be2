"""Safetensors checkpoints in the Hugging Face layout: single file or sharded with an index."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

logger = logging.getLogger(__name__)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files


def read_tensor(model_dir: str | Path, name: str) -> torch.Tensor | None:
    """One tensor of a checkpoint, None when no file holds it."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    return None


def iter_checkpoint(model_dir: str | Path):
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights, packed: dict[str, tuple[str, int]], prefix_map=None) -> list[str]:
    """Copy checkpoint tensors into model parameters, filling fused parameters shard by shard.

    Returns the checkpoint names the model has no parameter for (the caller decides whether that
    is fine, e.g. MTP layers are loaded by their own module). Missing parameters are an error.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unused: list[str] = []
    for name, tensor in weights:
        if prefix_map is not None:
            name = prefix_map(name)
            if name is None:
                continue
        target, shard = name, None
        for hf_part, (fused, idx) in packed.items():
            if f".{hf_part}." in name:
                target, shard = name.replace(f".{hf_part}.", f".{fused}."), idx
                break
        param = params.get(target)
        if param is None:
            unused.append(name)
            continue
        with torch.no_grad():
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                param.copy_(tensor)
            else:
                sizes = _shard_sizes(model, target, param)
                offset = sum(sizes[:shard])
                if tensor.shape[0] != sizes[shard]:
                    raise ValueError(f"{name}: checkpoint rows {tensor.shape[0]} != expected {sizes[shard]}")
                param[offset:offset + sizes[shard]].copy_(tensor)
        loaded.add(f"{target}#{shard}")
        loaded.add(target)
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return unused


def _shard_sizes(model: nn.Module, param_name: str, param: torch.Tensor) -> list[int]:
    owner = model.get_submodule(param_name.rsplit(".", 2)[0])
    if param_name.split(".")[-2] == "qkv_proj":
        return owner.shard_sizes
    half = param.shape[0] // 2
    return [half, half]


def unpacked_state_dict(model: nn.Module, packed: dict[str, tuple[str, int]]) -> dict[str, torch.Tensor]:
    """The model's parameters under checkpoint names, fused parameters split back into their parts."""
    by_fused: dict[str, list[tuple[int, str]]] = {}
    for hf_part, (fused, idx) in packed.items():
        by_fused.setdefault(fused, []).append((idx, hf_part))
    out = {}
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 2)[1]
        if leaf in by_fused:
            sizes = _shard_sizes(model, name, param)
            parts = param.detach().split(sizes, dim=0)
            for idx, hf_part in sorted(by_fused[leaf]):
                out[name.replace(f".{leaf}.", f".{hf_part}.")] = parts[idx].contiguous()
        else:
            out[name] = param.detach().contiguous()
    return out


def save_safetensors(state_dict: dict[str, torch.Tensor], path: str | Path, dtype: torch.dtype | None = None) -> None:
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in state_dict.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
