"""GGUF -> the Hugging Face layout the engine loads: `specserve convert`, and a cache of conversions.

A served GGUF file is converted once, into `<cache>/gguf/<sha256>-<dtype>/`; later starts find it there.
The folder appears whole or not at all: it is written under a temporary name and renamed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from specserve.gguf.cache import cache_dir, file_sha256
from specserve.gguf.reader import GGUFFile, is_gguf
from specserve.gguf.tokenizer import build_tokenizer, generation_config, tokenizer_config
from specserve.models.loader import save_safetensors
from specserve.models.registry import parse_dtype

logger = logging.getLogger(__name__)

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def convert(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and generation_config.json."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"cannot convert to {dtype}; choose one of {', '.join(DTYPE_NAMES.values())}")
    start = time.perf_counter()
    file = GGUFFile(gguf_path)
    config = {**file.hf_config(), "torch_dtype": DTYPE_NAMES[dtype]}
    tokenizer = build_tokenizer(file)       # before the weights: a bad tokenizer fails fast
    weights = {name: tensor.to(dtype) for name, tensor in file.tensors()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors(weights, out_dir / "model.safetensors")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(file))
    write_json(out_dir / "generation_config.json", generation_config(file))
    logger.info("converted %s to %s (%s) in %.1f s", gguf_path, out_dir, DTYPE_NAMES[dtype], time.perf_counter() - start)
    return out_dir


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def converted_dir(gguf_path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The cached conversion of a GGUF file (made now if there is none), keyed by the file's sha256."""
    root = cache_dir() / "gguf"
    out = root / f"{file_sha256(gguf_path)}-{DTYPE_NAMES[dtype]}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    logger.warning("converting %s to the Hugging Face layout (once; cached in %s)", gguf_path, out)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root))
    try:
        convert(gguf_path, tmp, dtype)
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():     # else another process finished the same conversion first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_dir(model: str | Path, dtype: str = "auto") -> str | Path:
    """What the engine loads for a model argument: a GGUF file's cached conversion; a folder as it is.
    The conversion is in the dtype the engine runs (bfloat16 for auto), so float32 gets the exact dequantized
    values rather than their bfloat16 rounding."""
    if not Path(model).exists():
        raise FileNotFoundError(f"model {model} does not exist (a model is a Hugging Face folder or a GGUF file)")
    if Path(model).is_dir():
        return model
    if not is_gguf(model):
        raise ValueError(f"model {model} is a file but not a GGUF file (a model is a Hugging Face folder or a GGUF file)")
    return converted_dir(model, torch.bfloat16 if dtype == "auto" else parse_dtype(dtype))
