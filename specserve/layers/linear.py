"""CPU inference linears: each weight's product on the kernel measured fastest for its shape and row count.

Which kernel wins depends on the CPU, the shape, the number of weights of that shape (do they stay in cache?)
and the rows of the step (benchmarks/NOTES.md, "SmolLM2"): oneDNN over a weight packed once into its blocked
layout streams a large weight fastest but costs ~10 us a call before reading a byte; MKL's plain F.linear wins
on small cache-resident weights with few rows; oneDNN packs bf16 weights only on CPUs with native bf16
conversions; on some CPUs oneDNN's bf16 product for a few rows runs far below the memory's bandwidth, where
the native bf16 kernel (AMX tiles or AVX512-BF16 dot products, layers/native_bf16.py) does not. So nothing here
is a threshold: at load, `choose_kernels` times every candidate on the model's own weights of each shape (all of
them in turn, so that cache effects are those of a real step) at one row count per bucket (1, 2-8, 9-32, more)
and keeps, of the families of kernels that give the same bits, the one whose row costs least over the buckets.
The choice is cached per machine in a JSON file (layers/kernel_cache.py) keyed by CPU model, torch version,
threads, dtype and shape.

A weight's buckets only ever compute the same bits, so that a verify step's rows are the rows plain decoding
would produce: in bf16, torch's kernels must agree with F.linear on a probe and a native kernel stands alone;
in fp32 the same sums to rounding; an int8 or int4 weight has a single kernel (the native one where the CPU runs
it). Packing is a module swap done by the engine after loading; training never sees it.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.kernel_cache import kernel_cache_path, load_cache, machine_key, save_cache
from specserve.layers.native_bf16 import AMX, BF16Linear, native_bf16_kernels, share_huge_pages, sum_order
from specserve.layers.quantization import (HEAD_QUANTIZATION, INT4_GROUP, A8Linear, can_quantize_int4, int4_linear,
                                           int8_linear, native_kernel, quantize_int4, quantize_int8)

logger = logging.getLogger(__name__)

BUCKET_ROWS = (1, 6, 24, 64)        # the rows timed for buckets 1, 2-8, 9-32 and more
Kernel = Callable[[torch.Tensor], torch.Tensor]


def bucket(rows: int) -> int:
    return 0 if rows == 1 else 1 if rows <= 8 else 2 if rows <= 32 else 3


def bf16_packing_supported() -> bool:
    """oneDNN packs bf16 weights only on CPUs with native bf16 conversions (AVX512-BW/VL/DQ or AVX-NE-CONVERT);
    on others (AVX2 only) `_reorder_linear_weight` raises, and bf16 products take F.linear instead."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_packing_supported())


def candidates(device: torch.device, dtype: torch.dtype, quantization: str | None,
               shape: tuple[int, int] | None = None) -> list[str]:
    """The kernels this CPU offers for one weight, first the reference the others must agree with. A quantized
    weight takes the native kernel where the CPU and its shape allow (layers/quantization.py), else torch's; int4
    needs whole groups along the input, and a weight without them stays int8."""
    native = native_kernel(quantization, shape) if quantization and shape else None
    if native:
        return [native]
    if quantization == "int4" and (shape is None or shape[1] % INT4_GROUP == 0):
        return ["int4"]
    if quantization in ("int8", "int4"):
        return ["int8"]
    torch_kernels = ["linear", "packed"] if can_pack(device, dtype) else ["linear"]
    return torch_kernels + (native_bf16_kernels(shape) if device.type == "cpu" and dtype == torch.bfloat16 else [])


def make_kernel(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Kernel:
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if name == "linear":
        return functools.partial(F.linear, weight=weight, bias=bias)
    if name == "packed":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        pointwise = torch.ops.mkldnn._linear_pointwise
        return lambda x: pointwise(x, packed, bias, "none", [], "")
    # a bf16 model without a bias calls the quantized op directly: no conversions, one Python frame less
    direct = weight.dtype == torch.bfloat16 and bias is None
    if name == "int8":
        q, scales = quantize_int8(weight)
        if direct:      # a partial of the aten op: a compiled graph calls it itself (models/compiled.py)
            return functools.partial(torch.ops.aten._weight_int8pack_mm, mat2=q, scales=scales)
        return functools.partial(int8_linear, q=q, scales=scales, bias=bias)
    if name == "int4" and can_quantize_int4(weight):
        packed, scales_and_zeros = quantize_int4(weight)
        if direct:
            return functools.partial(torch.ops.aten._weight_int4pack_mm_for_cpu, mat2=packed, qGroupSize=INT4_GROUP,
                                     qScaleAndZeros=scales_and_zeros)
        return functools.partial(int4_linear, packed=packed, scales_and_zeros=scales_and_zeros, bias=bias)
    if name in ("w8a8", "w4a8"):
        return A8Linear(weight, bias, bits=8 if name == "w8a8" else 4)
    if name in native_bf16_kernels(tuple(weight.shape)):
        return BF16Linear(weight, bias, amx=name == AMX)
    raise ValueError(f"unknown kernel {name!r}")


class InferenceLinear(nn.Module):
    """One weight's product, on the kernel chosen for the step's row bucket."""

    def __init__(self, in_features: int, out_features: int, kernels: dict[str, Kernel], choice: list[str]):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.choice = choice                                    # kernel name per bucket
        self.by_bucket = [kernels[name] for name in choice]     # only the chosen kernels' weights stay alive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return self.by_bucket[0 if rows == 1 else 1 if rows <= 8 else 2 if rows <= 32 else 3](x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernels={self.choice}"


# ---- choosing kernels ---------------------------------------------------------------------------------------
def time_kernels(kernels: dict[str, list[Kernel]], x: torch.Tensor, repeats: int = 5) -> dict[str, float]:
    """Seconds per product of each kernel, each run over every weight of the group in turn (min of repeats,
    the kernels interleaved so that a change in the machine's load hits all of them)."""
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(repeats + 1):                    # the first round warms up
        for name, group in kernels.items():
            start = time.perf_counter()
            for k in group:
                k(x)
            best[name] = min(best[name], (time.perf_counter() - start) / len(group))
    return best


def one_row_as_two(kernel: Kernel) -> Kernel:
    """A one-row product computed as a two-row one (the row twice). oneDNN and MKL take a matrix-vector path
    for a single row whose sums round differently from those of every product of two rows or more, so a decode
    step's row would not be the row a verify step computes for the same token."""
    def run(x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1]:                 # more than one row, in any leading shape
            return kernel(x)
        return kernel(x.reshape(1, -1).expand(2, -1).contiguous())[:1].view(*x.shape[:-1], -1)
    return run


def row_invariant(kernel: Kernel, probe: torch.Tensor) -> Kernel | None:
    """The kernel (wrapped by one_row_as_two if its single-row path rounds differently) if each row of its
    products of BUCKET_ROWS rows equals that row's own two-row product, bit for bit; else None."""
    alone = torch.cat([kernel(row.expand(2, -1).contiguous())[:1] for row in probe.split(1)])
    if not all(torch.equal(kernel(probe[:n]), alone[:n]) for n in BUCKET_ROWS[1:]):
        return None
    one = torch.cat([kernel(row) for row in probe.split(1)])
    return kernel if torch.equal(one, alone) else one_row_as_two(kernel)


@torch.inference_mode()
def choose_kernels(weights: list[torch.Tensor], biases: list[torch.Tensor | None], names: list[str],
                   dtype: torch.dtype, cache: dict, key: str) -> tuple[list[str], dict[str, list[Kernel]]]:
    """The kernel name per bucket for a group of same-shape weights, and the kernels built for them.

    Exactness comes first: a verify step's rows must be the rows plain decoding computes, so only kernels
    whose every row is the same whatever the rows beside it are candidates (checked on a probe of the group's
    first weight), and the buckets take kernels of one family, which give the same bits as each other (oneDNN's
    and MKL's products; the native bf16 kernels, whose sums run in another order, each form their own). Then
    speed chooses: per family the fastest kernel of each bucket, and the family whose row costs least summed
    over the buckets."""
    cached = cache.get(key)
    if cached and "two_rows" in cached and set(cached["choice"]) <= set(names):     # chosen before: build only those
        return cached["choice"], {n: [one_row_as_two(k) if cached["two_rows"][n] else k
                                      for k in (make_kernel(n, w, b) for w, b in zip(weights, biases))]
                                  for n in set(cached["choice"])}
    probe = torch.randn(BUCKET_ROWS[-1], weights[0].shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
    kernels, two_rows = {}, {}
    for n in names:
        built = [make_kernel(n, w, b) for w, b in zip(weights, biases)]
        checked = row_invariant(built[0], probe)
        if checked is None:
            logger.info("kernel %s: its rows depend on the rows beside them on this CPU; not used", n)
            continue
        two_rows[n] = checked is not built[0]
        kernels[n] = [one_row_as_two(k) for k in built] if two_rows[n] else built
    if not kernels:             # none is row-invariant: the reference, and greedy speculation exact only to rounding
        logger.warning("no row-invariant kernel for a %s weight %s on this CPU: verify rows may differ from decode "
                       "rows in the last bits", dtype, tuple(weights[0].shape))
        kernels, two_rows = {names[0]: [make_kernel(names[0], w, b) for w, b in zip(weights, biases)]}, {names[0]: False}
    reference = (kernels[names[0]][0] if names[0] in kernels else make_kernel(names[0], weights[0], biases[0]))(probe)
    families = product_families(kernels, probe, reference, weights[0], biases[0])
    in_use = {n: kernels[n] for family in families for n in family}
    timings = [time_kernels(in_use, torch.randn(rows, weights[0].shape[1]).to(dtype)) for rows in BUCKET_ROWS]

    def plan(family: list[str]) -> list[str]:
        return [min(family, key=seconds.get) for seconds in timings]

    def cost(family: list[str]) -> float:           # a row in each bucket: decode, verify, a tree, a prompt chunk
        return sum(seconds[n] / rows for seconds, n, rows in zip(timings, plan(family), BUCKET_ROWS))
    choice = plan(min(families, key=cost))
    timings = [{n: round(s * 1e6, 1) for n, s in seconds.items()} for seconds in timings]
    cache[key] = {"choice": choice, "us": timings, "two_rows": {n: two_rows[n] for n in in_use}}
    return choice, kernels


def product_families(kernels: dict[str, list[Kernel]], probe: torch.Tensor, reference: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None) -> list[list[str]]:
    """The kernels that compute the weight's product (within twice the reference kernel's error against float64
    on the probe), grouped by the bits they give: kernels of one family may share a weight's buckets, kernels of
    two may not (a decode row and a verify row would round differently). Kernels that sum in different orders
    are never one family, even where the probe's bits happen to agree."""
    exact = probe.double() @ weight.double().T + (0 if bias is None else bias.double())
    outputs = {n: group[0](probe) for n, group in kernels.items()}
    bound = 2 * (reference.double() - exact).abs().max() + 1e-6 * exact.abs().max()
    families: list[list[str]] = []
    for n, out in outputs.items():
        if (out.double() - exact).abs().max() > bound:
            logger.info("kernel %s: not the product of the weight on this CPU; not used", n)
            continue
        if same := next((f for f in families if sum_order(f[0]) == sum_order(n) and torch.equal(outputs[f[0]], out)),
                        None):
            same.append(n)
        else:
            families.append([n])
    return families


def inference_linears(layers: list[tuple[torch.Tensor, torch.Tensor | None]], device: torch.device,
                      dtype: torch.dtype, quantization: str | None = None) -> list[InferenceLinear]:
    """An InferenceLinear per (weight, bias), kernels chosen per group of equal shapes."""
    path = kernel_cache_path()
    cache = load_cache(path)
    size = len(cache)
    groups: dict[tuple, list[int]] = {}
    for i, (w, b) in enumerate(layers):
        groups.setdefault((tuple(w.shape), b is not None), []).append(i)
    out: list[InferenceLinear | None] = [None] * len(layers)
    for (shape, has_bias), idx in groups.items():
        names = candidates(device, dtype, quantization, shape)
        key = (f"{machine_key()} | {dtype} {quantization or 'none'} | {shape[0]}x{shape[1]}"
               f"{' bias' if has_bias else ''} x{len(idx)} | {','.join(names)}")
        choice, kernels = choose_kernels([layers[i][0] for i in idx], [layers[i][1] for i in idx], names,
                                         dtype, cache, key)
        for j, i in enumerate(idx):
            out[i] = InferenceLinear(shape[1], shape[0], {n: kernels[n][j] for n in set(choice)}, choice)
    if len(cache) != size:
        save_cache(path, cache)
    return out


def pack_linears(module: nn.Module, device: torch.device, dtype: torch.dtype,
                 quantization: str | None = None, extra: dict[str, tuple[torch.Tensor, None]] | None = None) -> nn.Module:
    """Swaps every nn.Linear of `dtype` under `module` for an InferenceLinear on CPU; returns `module`.
    `extra` names more (weight, bias) pairs to set as attributes of `module` (a tied head's copy). An output head
    (`lm_head`) takes HEAD_QUANTIZATION's precision where it differs."""
    if device.type != "cpu":
        return module
    sites = [(owner, name, (child.weight, child.bias)) for owner in module.modules()
             for name, child in owner.named_children() if isinstance(child, nn.Linear) and child.weight.dtype == dtype]
    sites += [(module, name, pair) for name, pair in (extra or {}).items()]
    head = HEAD_QUANTIZATION.get(quantization, quantization)
    for q in dict.fromkeys((quantization, head)):
        part = [site for site in sites if (head if site[1] == "lm_head" else quantization) == q]
        if part:
            for (owner, name, _), lin in zip(part, inference_linears([pair for *_, pair in part], device, dtype, q)):
                setattr(owner, name, lin)
    share_huge_pages(list({id(k): k for m in module.modules() if isinstance(m, InferenceLinear)
                           for k in m.by_bucket if isinstance(k, BF16Linear)}.values()))
    return module
