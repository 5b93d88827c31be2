"""Where and in what dtype a model runs, with how many CPU threads, and how freed memory goes back."""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

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
# a forward over at least this many tokens (a prompt chunk, a large batch) runs on every core, even where the server
# leaves one to its HTTP front end: its products are long enough that a thread the event loop delays costs less than
# the second core gains (SmolLM2 served on two cores, random prompts: 1.3-1.5x plain decoding's throughput at 4-32
# concurrent requests; from 4 or 8 tokens, decode steps of 8 sequences ran slower than on one thread, from 32 those
# of 16 did)
WIDE_FORWARD_TOKENS = 16


@dataclass(slots=True)
class ForwardThreads:
    """The intra-op threads of a forward by its size (`fit`): `narrow` for decode-sized ones, `wide` from
    WIDE_FORWARD_TOKENS tokens. One per process (torch's threads are the process's); the same bits either way."""
    narrow: int = 0         # 0: leave torch's setting alone
    wide: int = 0

    @property
    def wide_from(self) -> int | None:
        """The tokens from which a forward takes `wide` threads; None where the count never changes."""
        return WIDE_FORWARD_TOKENS if self.narrow and self.wide > self.narrow else None

    def fit(self, tokens: int) -> None:
        if self.narrow:
            threads = self.wide if tokens >= WIDE_FORWARD_TOKENS else self.narrow
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)


FORWARD_THREADS = ForwardThreads()


def set_cpu_threads(num_threads: int | None, model: torch.nn.Module, reserved_cores: int = 0) -> None:
    """A model whose weights fit in the last-level cache is bound by per-op overhead, which a second
    thread does not shorten; it runs on one thread, which also keeps it fast when other processes
    load the cores (a busy-waiting thread pool can then be 20x slower). Larger models use every core but
    `reserved_cores`, which the server leaves to its HTTP front end: an intra-op pool that needs every core
    stalls each time the event loop or a client takes one (benchmarks/NOTES.md, serving threads). Their forwards
    over WIDE_FORWARD_TOKENS tokens or more still take every core (FORWARD_THREADS): on two cores a 256-token
    prompt took ~400 ms on one thread in the server, 210 ms on two offline."""
    cores = max(torch.get_num_threads(), FORWARD_THREADS.wide)     # an earlier engine's last forward may be narrow
    FORWARD_THREADS.narrow = FORWARD_THREADS.wide = 0
    if num_threads is None:
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if weight_bytes >= CACHE_RESIDENT_BYTES and not reserved_cores:
            if cores != torch.get_num_threads():
                torch.set_num_threads(cores)
            return
        num_threads = 1 if weight_bytes < CACHE_RESIDENT_BYTES else max(1, cores - reserved_cores)
        if weight_bytes >= CACHE_RESIDENT_BYTES and num_threads < cores:
            FORWARD_THREADS.narrow, FORWARD_THREADS.wide = num_threads, cores
    torch.set_num_threads(num_threads)
    logger.info("CPU threads: %d%s", num_threads, f" ({FORWARD_THREADS.wide} for forwards of "
                f"{WIDE_FORWARD_TOKENS} tokens or more)" if FORWARD_THREADS.narrow else "")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # mallopt's parameters (glibc's malloc.h)
MMAP_THRESHOLD = 32 << 20           # glibc's largest: blocks under it come from the heap and are reused from there
TRIM_THRESHOLD = 1 << 30            # free memory a heap keeps before it gives some back to the kernel


def keep_freed_memory() -> bool:
    """Let glibc's malloc (torch's CPU allocator) keep the memory a step frees for the next step, instead of giving
    it back to the kernel and faulting every page of it in again. By default its thresholds move with what was freed
    so far (the mmap threshold rises to the largest block freed, the trim threshold to twice that), so a process's
    speed depended on the order of the work it had seen: the server's engine thread allocates from its own arena,
    and a plain server that had served 8 concurrent 256-token prompts before 32 ran the 32 at 207-218 output tokens/s,
    against 264-280 for one that met the 32 first (AMD EPYC Zen 5, SmolLM2; benchmarks/NOTES.md, session 44).
    Fixed thresholds made the two alike. False where the C library has no mallopt or refuses the values."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def configure_cpu(num_threads: int | None, model: torch.nn.Module, reserved_cores: int = 0) -> None:
    """A CPU engine's process settings: its threads (set_cpu_threads) and its allocator (keep_freed_memory)."""
    keep_freed_memory()
    set_cpu_threads(num_threads, model, reserved_cores)
