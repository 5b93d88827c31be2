"""Weight-only int8: one scale per output row, products by torch's `_weight_int8pack_mm`.

A row's weights w become q = round(w / s) in [-127, 127] with s = max|w| / 127, rounded to bf16 first so that
the kernel multiplies by exactly the scale q was computed against. Activations stay bf16 (the kernel is ~10x
slower on fp32 ones: ../shared/PERF-NOTES.md), so an fp32 model converts each product's input and output.
"""
from __future__ import annotations

import torch

QUANTIZATIONS = ("int8",)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q int8 [out, in], scales bf16 [out])."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.aten._weight_int8pack_mm(x.to(scales.dtype), q, scales)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)
