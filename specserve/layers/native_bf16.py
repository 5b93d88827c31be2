"""bf16 products on the native kernel (kernels/bf16_linear.c): AMX tiles where the CPU has AMX-BF16, else
AVX512-BF16 dot products. Their sums are formed in another order than oneDNN's, so they are a family of their
own: the linear chooser (layers/linear.py) uses one family for all of a weight's row buckets."""
from __future__ import annotations

import ctypes
import sys

import torch
import torch.nn.functional as F

from specserve.layers import kernels

AMX, AVX512 = "bf16-amx", "bf16-avx512"


def native_bf16_kernels(shape: tuple[int, int] | None) -> list[str]:
    """The native bf16 kernels this CPU runs for a weight of `shape` [out, in] (AMX: inputs in whole 32s)."""
    lib, amx = kernels.bf16_linear_library()
    if lib is None or (shape is not None and shape[1] % 2):
        return []
    return ([AMX] if amx and (shape is None or shape[1] % 32 == 0) else []) + [AVX512]


def sum_order(name: str) -> str:
    """Kernels of one sum order may give the same bits: each native path has its own; torch's kernels share one
    and are told apart by a probe (layers/linear.py)."""
    return name if name in (AMX, AVX512) else "torch"


class BF16Linear:
    """One bf16 weight packed for the kernel: tiles of 16 outputs, each pair of inputs 16 lanes of two bf16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, amx: bool):
        self.out_features, self.in_features = weight.shape
        self.lib, _ = kernels.bf16_linear_library()
        self.amx = int(amx)
        w = F.pad(weight.detach().to(torch.bfloat16), (0, 0, 0, -self.out_features % 16))
        self.packed = w.view(-1, 16, self.in_features // 2, 2).transpose(1, 2).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.pointers = (self.packed.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
            return self(x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()).view(
                *x.shape[:-1], self.out_features).to(x.dtype)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        if x.shape[0] and self.lib.bf16_linear(x.data_ptr(), *self.pointers, y.data_ptr(), x.shape[0],
                                               self.in_features, self.out_features, torch.get_num_threads(),
                                               self.amx) != 0:
            raise ValueError(f"the native bf16 kernel cannot take a {self.out_features}x{self.in_features} weight")
        return y


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def share_huge_pages(kernels: list[BF16Linear]) -> torch.Tensor | None:
    """Moves the kernels' packed weights into one buffer that the kernel backs with 2 MiB pages (transparent huge
    pages, advised before the buffer's first touch), and returns it; None where it cannot (not Linux, no madvise).
    The kernel streams its tiles at ~38 GB/s, and on 4 KiB pages the page walks showed: SmolLM2's head ran 1.06x and
    its 30 fused gate-up weights 1.04x faster on huge pages, one row on one thread (benchmarks/NOTES.md, session 47).
    One buffer for all, because most of a small model's weights (1.77 MB for SmolLM2's down projections) are each
    under a huge page. Only these weights: torch's own setting for it (THP_MEM_ALLOC_ENABLE) advises every buffer of
    2 MiB and more, and large temporaries then took 4-15x longer to make."""
    if not kernels or not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    sizes = [-(-k.packed.nbytes // 64) * 64 for k in kernels]          # each weight 64-byte aligned
    length = -(-sum(sizes) // HUGE_PAGE) * HUGE_PAGE
    buffer = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)       # a model's: its own mapping, untouched yet
    start = -buffer.data_ptr() % HUGE_PAGE
    if madvise(buffer.data_ptr() + start, length, MADV_HUGEPAGE) != 0:
        return None
    offset = start
    for kernel, size in zip(kernels, sizes):
        packed = buffer[offset:offset + kernel.packed.nbytes].view(kernel.packed.dtype).view(kernel.packed.shape)
        packed.copy_(kernel.packed)
        kernel.packed, kernel.pointers = packed, (packed.data_ptr(), kernel.pointers[1])
        offset += size
    return buffer
