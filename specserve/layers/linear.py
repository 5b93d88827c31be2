"""CPU inference linears: weights pre-packed once into oneDNN's blocked layout.

`F.linear` on CPU re-reads a plain row-major weight through a generic path that streams at about 17 GB/s
here whatever the thread count, and in fp32 its cost grows with every row it multiplies. A weight packed
for the kernel streams at 40-45 GB/s (2 threads, weights not in cache) and a verify step of k + 1 rows
costs little more than one row (benchmarks/NOTES.md, "Plain decode"). The product is the same one (bf16:
bit for bit; fp32: the same sums in another order). Packing is a module swap done by the engine after
loading; training never sees a packed module.

The packed kernel costs about 10 us per call before it reads a byte, where MKL's fp32 product of a small
weight with a few rows takes 2-3 us: an fp32 weight under PACK_MIN_BYTES also keeps its plain copy, used
below PLAIN_MAX_ROWS rows. bf16 always takes the packed kernel (the plain one was slower at every size).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACK_MIN_BYTES = 1 << 20
PLAIN_MAX_ROWS = 3


def bf16_packing_supported() -> bool:
    """oneDNN packs bf16 weights only on CPUs with native bf16 conversions (AVX512-BW/VL/DQ or AVX-NE-CONVERT);
    on others (AVX2 only) `_reorder_linear_weight` raises, and bf16 products take F.linear instead."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_packing_supported())


def keeps_plain(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.numel() * weight.element_size() < PACK_MIN_BYTES


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.weight = weight.detach() if keeps_plain(weight) else None
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.shape[0] <= PLAIN_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Swaps every nn.Linear under `module` for a PackedLinear where packing applies; returns `module`."""
    if not can_pack(device, dtype):
        return module
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.dtype == dtype:
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child, device, dtype)
    return module
