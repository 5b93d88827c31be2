"""Weight-only quantization for CPU decoding, which reads every weight once per step: fewer bytes, faster steps.

int8: one scale per output row, products by torch's `_weight_int8pack_mm`. A row's weights w become
q = round(w / s) in [-127, 127] with s = max|w| / 127, rounded to bf16 first so that the kernel multiplies by
exactly the scale q was computed against.
int4: groups of INT4_GROUP inputs per row with a scale and a zero each (asymmetric, the layout of GGUF's Q4_1),
products by `_weight_int4pack_mm_for_cpu`, which reads w = (q - 8) * scale + zero with q in [0, 15].

On a CPU with AVX512-VNNI, int4 products take the native kernel instead (kernels/w4a8.c): the same groups of
32 stored as w = q * scale + min, each row's activations quantized per group of 32 to int8 on the fly, and
integer dot products, as llama.cpp computes Q4_1 x Q8_1 (a weight is read once for all the rows of a step, where
torch's kernel computes each row on its own: a verify step cost 2.3x a decode step). The rounding of the
activations adds an error of the order of int4's own (tests/test_linear.py bounds the logits' error).

Activations stay bf16 (the int8 kernel is ~10x slower on fp32 ones: ../shared/PERF-NOTES.md), so an fp32 model
converts each product's input and output. Both kernels compute each row alone (a verify step's rows are
those plain decoding would produce: tests/test_linear.py).
"""
from __future__ import annotations

import torch

from specserve.layers import kernels

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


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> its groups of INT4_GROUP as w = q * scale + min: q uint8 [out, in] in [0, 15], scales and
    mins bf16 [out, in / INT4_GROUP]."""
    out, inp = weight.shape
    w = weight.detach().float().view(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    scales, mins = ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16), lo.to(torch.bfloat16)
    q = torch.round((w - mins.float()[..., None]) / scales.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.view(out, inp), scales, mins


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


def can_run_w4a8(weight: torch.Tensor) -> bool:
    return weight.shape[0] % 16 == 0 and weight.shape[1] % INT4_GROUP == 0 and kernels.w4a8_library() is not None


class W4A8Linear:
    """A weight's int4 product on the native kernel (kernels/w4a8.c), in its layout: nibbles in tiles of 16
    outputs, scales and mins [out / 16, in / 32, 16]; bf16 or fp32 activations in, the same dtype out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        q, scales, mins = int4_groups(weight)
        self.out_features, self.in_features = n, k = weight.shape
        q = q.view(n // 16, 16, k // 8, 2, 4)
        self.packed = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
        tiles = lambda t: t.view(n // 16, 16, -1).transpose(1, 2).contiguous()
        self.scales, self.mins = tiles(scales), tiles(mins)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.lib = kernels.w4a8_library()
        self.pointers = [t.data_ptr() for t in (self.packed, self.scales, self.mins)] + \
            [None if self.bias is None else self.bias.data_ptr()]

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, fp32 [out, in]."""
        n, k = self.out_features, self.in_features
        q = torch.stack((self.packed & 15, self.packed >> 4), dim=2).permute(0, 3, 1, 2, 4).reshape(n, k).float()
        untile = lambda t: t.transpose(1, 2).reshape(n, -1, 1).float()
        return (q.view(n, -1, INT4_GROUP) * untile(self.scales) + untile(self.mins)).view(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous():
            return self(x.reshape(-1, self.in_features).to(x.dtype if x.dtype == torch.bfloat16 else torch.float32)
                        .contiguous()).view(*x.shape[:-1], self.out_features).to(x.dtype)
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        if x.shape[0] and self.lib.w4a8_linear(x.data_ptr(), x.dtype == torch.bfloat16, self.pointers[0],
                                               self.pointers[1], self.pointers[2], self.pointers[3], y.data_ptr(),
                                               x.shape[0], self.in_features, self.out_features,
                                               torch.get_num_threads()) != 0:
            raise MemoryError("the native int4 kernel could not allocate its activations' buffer")
        return y
