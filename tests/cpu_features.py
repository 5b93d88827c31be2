"""Making this CPU look like another to the code under test."""
import torch

from specserve.layers import kernels


def without_bf16_onednn(monkeypatch) -> None:
    """This CPU as an AVX2-only one looks to torch: mkldnn reports no bf16 support and refuses to pack a bf16
    weight with the error those CPUs raise, so that any bf16 oneDNN call left on the path fails here too; and
    the native bf16 kernel (AVX512-BF16) is off."""
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def refuse_bf16(weight, *args):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
                               "avx512bw, avx512vl and avx512dq")
        return reorder(weight, *args)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse_bf16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(kernels, "bf16_linear_library", lambda: (None, False))
