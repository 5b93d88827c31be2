"""Where and in what dtype a model runs, and with how many CPU threads."""
from __future__ import annotations

import logging

import torch

from specserve.models.config import ModelConfig
from specserve.models.registry import parse_dtype

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's dtype on CUDA; on CPU bf16 for a bf16 checkpoint where oneDNN has bf16 kernels
    (packed bf16 products are batch-invariant and about twice as fast as fp32 ones here), else fp32."""
    if dtype == "auto":
        if device.type == "cuda":
            return parse_dtype(config.torch_dtype or "bfloat16")
        if config.torch_dtype == "bfloat16" and torch.backends.mkldnn.is_available() \
                and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return parse_dtype(dtype)


CACHE_RESIDENT_BYTES = 32 << 20


def set_cpu_threads(num_threads: int | None, model: torch.nn.Module, reserved_cores: int = 0) -> None:
    """A model whose weights fit in the last-level cache is bound by per-op overhead, which a second
    thread does not shorten; it runs on one thread, which also keeps it fast when other processes
    load the cores (a busy-waiting thread pool can then be 20x slower). Larger models use every core but
    `reserved_cores`, which the server leaves to its HTTP front end: an intra-op pool that needs every core
    stalls each time the event loop or a client takes one (benchmarks/NOTES.md, serving threads)."""
    if num_threads is None:
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if weight_bytes >= CACHE_RESIDENT_BYTES and not reserved_cores:
            return
        num_threads = 1 if weight_bytes < CACHE_RESIDENT_BYTES else max(1, torch.get_num_threads() - reserved_cores)
    torch.set_num_threads(num_threads)
    logger.info("CPU threads: %d", num_threads)
