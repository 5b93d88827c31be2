"""Training checkpoints without pickle: one safetensors file holding every tensor, with the state's
structure as JSON in its header.

A state is nested dicts, lists, tuples, numbers, strings, None and tensors (a model's and an optimizer's
state_dict, counters, token ids). Each tensor is stored under its path ("optimizer.state.3.exp_avg")
and replaced in the JSON by {"tensor": path}; a dict whose keys are not all strings (an optimizer's
state, keyed by parameter index) is written as {"items": [[key, value], ...]}, a tuple as {"tuple": [...]}.
Loading reads JSON and raw tensors only, so a checkpoint cannot run code.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

STRUCTURE_KEY = "specserve.state"
MARKERS = ("tensor", "items", "tuple")


def save_state(path: Path, state: Any) -> None:
    """Written to a temporary file first, so an interrupted save leaves the previous checkpoint intact."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, "", tensors, set())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={STRUCTURE_KEY: json.dumps(structure)})
    os.replace(tmp, path)


def load_state(path: Path) -> Any:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if STRUCTURE_KEY not in metadata:
            raise ValueError(f"{path} is not a specserve training checkpoint (no {STRUCTURE_KEY!r} in its header)")
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    return _decode(json.loads(metadata[STRUCTURE_KEY]), tensors)


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor], storages: set[int]) -> Any:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        if tensor.numel() and tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone()                 # safetensors refuses tensors that share memory (tied weights)
        if tensor.numel():
            storages.add(tensor.untyped_storage().data_ptr())
        key = path or "."
        tensors[key] = tensor
        return {"tensor": key}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _is_marked(value):
            return {k: _encode(v, f"{path}.{k}" if path else k, tensors, storages) for k, v in value.items()}
        for k in value:
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"cannot checkpoint a dict key of type {type(k).__name__} at {path or 'the top'}")
        return {"items": [[k, _encode(v, f"{path}.{k}", tensors, storages)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{path}.{i}", tensors, storages) for i, v in enumerate(value)]
        return {"tuple": items} if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot checkpoint a {type(value).__name__} at {path or 'the top'}")


def _is_marked(value: dict) -> bool:
    return len(value) == 1 and next(iter(value)) in MARKERS


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if _is_marked(value):
        (marker, inner), = value.items()
        if marker == "tensor":
            return tensors[inner]
        if marker == "tuple":
            return tuple(_decode(v, tensors) for v in inner)
        return {k: _decode(v, tensors) for k, v in inner}
    return {k: _decode(v, tensors) for k, v in value.items()}
