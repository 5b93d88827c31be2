"""The native quantized kernel (layers/kernels/a8_linear.c), 4 and 8 bits: its layout round trips to the groups it
was given, its products are those of its documented arithmetic (int8 activations per group of 32 against
q * scale [+ min]), a row's bits do not depend on the rows beside it or on the threads, the output head stays at 8
bits under int4, and on a CPU without AVX512-VNNI torch's kernels are kept."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers import kernels, linear
from specserve.layers.linear import InferenceLinear, pack_linears
from specserve.layers.quantization import INT4_GROUP, A8Linear, int4_groups

CPU = torch.device("cpu")
native = pytest.mark.skipif(kernels.a8_linear_library() is None, reason="no AVX512-VNNI (or no C compiler) on this CPU")


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (a [M, K] in [-127, 127], d [M, K / 32]) as the kernel quantizes: fp32, nearest even."""
    g = x.float().view(x.shape[0], -1, INT4_GROUP)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(g * inv[..., None]).view_as(x.float()), amax / 127.0


def reference(x: torch.Tensor, lin: A8Linear) -> torch.Tensor:
    """The kernel's products in float64 from the same quantized activations and weights."""
    a, d = quantized_activations(x)
    w = lin.dequantized().double()
    m, k = a.shape
    per_group = torch.einsum("mgk,ngk->mng", a.double().view(m, -1, INT4_GROUP), w.view(-1, k // INT4_GROUP, INT4_GROUP))
    return (per_group * d.double()[:, None, :]).sum(-1)


def groups(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as the kernel should hold it, and its largest quantization step."""
    n, k = w.shape
    if bits == 4:
        q, scales, mins = int4_groups(w)
        return (q.float().view(n, -1, INT4_GROUP) * scales.float()[..., None] + mins.float()[..., None]).view(n, k), \
            scales.float().max()
    g = w.float().view(n, -1, INT4_GROUP)
    scales = (g.abs().amax(-1) / 127).to(torch.bfloat16).float()
    return (torch.round(g / scales[..., None]).clamp(-127, 127) * scales[..., None]).view(n, k), scales.max()


@native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(48, 64), (576, 576), (96, 1536), (2600, 576), (3, 32)])    # tiles of 16: not all whole
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_products_follow_the_documented_arithmetic(bits, shape, dtype):
    torch.manual_seed(0)
    n, k = shape
    w, bias = torch.randn(n, k) * 0.05, torch.randn(n)
    lin = A8Linear(w.to(dtype), bias, bits)
    rebuilt, step = groups(w.to(dtype), bits)
    assert torch.equal(lin.dequantized(), rebuilt)                                    # the layout round trips
    assert (rebuilt - w.to(dtype).float()).abs().max() <= 0.51 * step                  # one level at most
    x = torch.randn(13, k).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (13, n)
    ref = reference(x, lin) + bias.double()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5                                    # the output's rounding
    assert ((y.double() - ref).abs() / ref.abs().clamp_min(1)).max() <= tol
    exact = F.linear(x.double(), rebuilt.double(), bias.double())                      # unquantized activations
    assert (y.double() - exact).abs().max() <= 0.02 * exact.abs().max()


@native
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_the_same_whatever_rows_and_threads_are_beside_it(bits, two_threads):
    torch.manual_seed(1)
    lin = A8Linear(torch.randn(3064, 576).bfloat16() * 0.05, None, bits)       # the last tile padded
    x = torch.randn(19, 576).bfloat16()
    threads = torch.get_num_threads()
    try:
        together = lin(x)
        torch.set_num_threads(1)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(19)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    assert torch.equal(lin(x.view(1, 19, 576)).view(19, -1), together)                # leading dims, one call
    assert lin(x[:0]).shape == (0, 3064)
    zero = torch.zeros(2, 576).bfloat16()                                              # groups of zeros: d = 0
    assert torch.equal(lin(zero), torch.zeros(2, 3064).bfloat16())


def test_quantized_weights_take_the_native_kernel_where_the_cpu_runs_it(monkeypatch):
    has = kernels.a8_linear_library() is not None
    assert linear.candidates(CPU, torch.bfloat16, "int4", (96, 64)) == ["w4a8" if has else "int4"]
    assert linear.candidates(CPU, torch.bfloat16, "int8", (96, 64)) == ["w8a8" if has else "int8"]
    assert linear.candidates(CPU, torch.bfloat16, "int4", (40, 64)) == ["w4a8" if has else "int4"]  # a padded tile
    assert linear.candidates(CPU, torch.bfloat16, "int8", (96, 40)) == ["int8"]        # not whole groups of 32
    monkeypatch.setattr(kernels, "a8_linear_library", lambda: None)                   # an AVX2-only CPU
    assert linear.candidates(CPU, torch.bfloat16, "int4", (96, 64)) == ["int4"]
    assert linear.candidates(CPU, torch.bfloat16, "int8", (96, 64)) == ["int8"]


def test_int4_keeps_the_output_head_at_8_bits(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    model = nn.Module()
    model.layer, model.lm_head = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
    pack_linears(model.bfloat16(), CPU, torch.bfloat16, "int4", extra={"lm_head_copy": (torch.randn(48, 64), None)})
    assert model.layer.choice[0] in ("w4a8", "int4") and model.lm_head.choice[0] in ("w8a8", "int8")
    assert isinstance(model.lm_head_copy, InferenceLinear) and model.lm_head_copy.choice[0] in ("w4a8", "int4")
