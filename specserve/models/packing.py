"""Freezing a model or a drafter module for inference: packed linears, fused norms, frozen weight bundles."""
from __future__ import annotations

import torch
from torch import nn

from specserve.layers.linear import pack_linears
from specserve.models.llama import Attention, DecoderLayer, RMSNorm, rms_norm_fused


def pack_for_inference(module: nn.Module, device: torch.device, dtype: torch.dtype, quantization: str | None = None,
                       extra: dict | None = None) -> nn.Module:
    """For inference only (not trainable afterwards): on CPU every linear on the kernels measured fastest for
    its shape (layers/linear.py; int8 weights with quantization="int8"), each layer's weights frozen into its
    bundle, so that a forward makes no nn.Module calls inside the layers, and every RMSNorm on the fused
    kernel (rms_norm_fused). `extra`: more (weight, bias) pairs made attributes of `module` (a tied head)."""
    pack_linears(module, device, dtype, quantization, extra)
    for m in module.modules():      # the norms first: the frozen bundles take each layer's norm function
        if isinstance(m, RMSNorm) and m.weight.is_cpu:
            m.norm = rms_norm_fused
    for m in module.modules():
        if isinstance(m, (Attention, DecoderLayer)):
            m.frozen = m.weights(frozen=True)
    return module
