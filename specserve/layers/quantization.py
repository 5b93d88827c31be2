"""Weight-only quantization for CPU decoding, which reads every weight once per step: fewer bytes, faster steps.

int8: one scale per output row, products by torch's `_weight_int8pack_mm`. A row's weights w become
q = round(w / s) in [-127, 127] with s = max|w| / 127, rounded to bf16 first so that the kernel multiplies by
exactly the scale q was computed against.
int4: groups of INT4_GROUP inputs per row with a scale and a zero each (asymmetric, the layout of GGUF's Q4_1),
products by `_weight_int4pack_mm_for_cpu`, which reads w = (q - 8) * scale + zero with q in [0, 15].

Activations stay bf16 (the int8 kernel is ~10x slower on fp32 ones: ../shared/PERF-NOTES.md), so an fp32 model
converts each product's input and output. Both kernels compute each row alone (a verify step's rows are
those plain decoding would produce: tests/test_linear.py).
"""
from __future__ import annotations

import torch

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP = 32


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


def can_quantize_int4(weight: torch.Tensor) -> bool:
    return weight.shape[1] % INT4_GROUP == 0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (packed uint8 [out, in / 2] in the CPU kernel's layout, scales_and_zeros bf16
    [in / INT4_GROUP, out, 2])."""
    out, inp = weight.shape
    w = weight.detach().float().view(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16)
    zeros = (lo + 8 * scales.float()).to(torch.bfloat16)                   # w = (q - 8) * scale + zero
    base = zeros.float() - 8 * scales.float()
    q = torch.round((w - base[..., None]) / scales.float()[..., None]).clamp_(0, 15).to(torch.int32).view(out, inp)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(scales_and_zeros.dtype), packed, INT4_GROUP, scales_and_zeros)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)
