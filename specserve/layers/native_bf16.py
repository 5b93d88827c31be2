"""bf16 products on the native kernel (kernels/bf16_linear.c): AMX tiles where the CPU has AMX-BF16, else
AVX512-BF16 dot products. Their sums are formed in another order than oneDNN's, so they are a family of their
own: the linear chooser (layers/linear.py) uses one family for all of a weight's row buckets."""
from __future__ import annotations

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
