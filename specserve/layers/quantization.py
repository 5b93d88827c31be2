"""Quantized weights for CPU decoding, which reads every weight once per step: fewer bytes, faster steps.

Where the CPU has AVX512-VNNI (and a C compiler is found), both take the native kernel (kernels/a8_linear.c):
weights in groups of 32 inputs, each row's activations quantized per group of 32 to int8 on the fly, and integer
dot products, as llama.cpp computes Q8_0 x Q8_0 and Q4_1 x Q8_1. A weight is read once for all the rows of a
step (torch's kernels compute each row on its own: a verify step cost 2.3x a decode step). The activations'
rounding adds an error well under the weights' own (tests/test_linear.py bounds the logits' error).
- int8: w = q * scale, q in [-127, 127] (Q8_0).
- int4: w = q * scale + min, q in [0, 15] (Q4_1). The output head stays int8, as llama.cpp's Q4 files keep
  theirs at 6-8 bits: on SmolLM2 an int4 head was 85% of int4's divergence from the model (NOTES, session 13).

Elsewhere, weight-only kernels from torch with bf16 activations:
- int8: one scale per output row, products by torch's `_weight_int8pack_mm`. A row's weights w become
  q = round(w / s) in [-127, 127] with s = max|w| / 127, rounded to bf16 first so that the kernel multiplies by
  exactly the scale q was computed against.
- int4: groups of INT4_GROUP inputs per row with a scale and a zero each (asymmetric, the layout of GGUF's Q4_1),
  products by `_weight_int4pack_mm_for_cpu`, which reads w = (q - 8) * scale + zero with q in [0, 15].
  (torch's int8 kernel is ~10x slower on fp32 activations: ../shared/PERF-NOTES.md, so an fp32 model converts
  each product's input and output.)

Every kernel computes each row alone (a verify step's rows are those plain decoding would produce:
tests/test_linear.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.layers import kernels

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP = 32
HEAD_QUANTIZATION = {"int4": "int8"}        # the output head's precision where the layers' is lower


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


def int4_ranges(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (its groups of INT4_GROUP fp32 [out, in / INT4_GROUP, INT4_GROUP], each group's min
    fp32, its scale (max - min) / 15 in bf16)."""
    out, inp = weight.shape
    w = weight.detach().float().view(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    return w, lo, ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16)


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> its groups of INT4_GROUP as w = q * scale + min: q uint8 [out, in] in [0, 15], scales and
    mins bf16 [out, in / INT4_GROUP]."""
    w, lo, scales = int4_ranges(weight)
    mins = lo.to(torch.bfloat16)
    q = torch.round((w - mins.float()[..., None]) / scales.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.view(weight.shape), scales, mins


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (packed uint8 [out, in / 2] in the CPU kernel's layout, scales_and_zeros bf16
    [in / INT4_GROUP, out, 2])."""
    out, inp = weight.shape
    w, lo, scales = int4_ranges(weight)
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


def native_kernel(quantization: str, shape: tuple[int, int]) -> str | None:
    """The native kernel's name ("w8a8" / "w4a8") for a weight of `shape` [out, in], or None where this CPU or
    the shape cannot take it (inputs in whole groups of 32)."""
    if shape[1] % INT4_GROUP or kernels.a8_linear_library() is None:
        return None
    return {"int8": "w8a8", "int4": "w4a8"}.get(quantization)


def tiled(t: torch.Tensor) -> torch.Tensor:
    """[out, in / 32] per-group values -> the kernel's [out / 16, in / 32, 16]."""
    return t.view(t.shape[0] // 16, 16, -1).transpose(1, 2).contiguous()


def untiled(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, t.shape[1])


class A8Linear:
    """A weight's product on the native kernel (kernels/a8_linear.c) in its layout, 4 or 8 bits; bf16 or fp32
    activations in, the same dtype out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int):
        self.out_features, self.in_features = weight.shape
        self.bits = bits
        weight = F.pad(weight.detach(), (0, 0, 0, -weight.shape[0] % 16))      # the last tile's zero rows
        n, k = weight.shape
        if bits == 4:
            q, scales, aux = int4_groups(weight)
            q = q.view(n // 16, 16, k // 8, 2, 4)
            self.packed = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
        else:                 # int8's one scale a row, here a row per group of 32 (Q8_0)
            q, scales = quantize_int8(weight.reshape(-1, INT4_GROUP))
            scales, aux = scales.view(n, -1), q.view(n, -1, INT4_GROUP).sum(-1, dtype=torch.int16)   # aux: sum(q)
            self.packed = q.view(n // 16, 16, k // 4, 4).transpose(1, 2).contiguous()
        self.scales, self.aux = tiled(scales), tiled(aux)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.lib = kernels.a8_linear_library()
        self.pointers = [t.data_ptr() for t in (self.packed, self.scales, self.aux)] + \
            [None if self.bias is None else self.bias.data_ptr()]

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, fp32 [out, in]."""
        n, k = self.packed.shape[0] * 16, self.in_features                   # the tiles' rows, padding included
        scales = untiled(self.scales).float()[..., None]
        if self.bits == 8:
            q = self.packed.transpose(1, 2).reshape(n, k).float()
            return (q.view(n, -1, INT4_GROUP) * scales).view(n, k)[:self.out_features]
        q = torch.stack((self.packed & 15, self.packed >> 4), dim=2).permute(0, 3, 1, 2, 4).reshape(n, k).float()
        w = q.view(n, -1, INT4_GROUP) * scales + untiled(self.aux).float()[..., None]
        return w.view(n, k)[:self.out_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous():
            return self(x.reshape(-1, self.in_features).to(x.dtype if x.dtype == torch.bfloat16 else torch.float32)
                        .contiguous()).view(*x.shape[:-1], self.out_features).to(x.dtype)
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        if x.shape[0] and self.lib.a8_linear(self.bits, x.data_ptr(), x.dtype == torch.bfloat16, self.pointers[0],
                                             self.pointers[1], self.pointers[2], self.pointers[3], y.data_ptr(),
                                             x.shape[0], self.in_features, self.out_features,
                                             torch.get_num_threads()) != 0:
            raise MemoryError("the native quantized kernel could not allocate its activations' buffer")
        return y
