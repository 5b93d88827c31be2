"""CPU inference linears: each weight's product on the kernel measured fastest for its shape and row count.

Which kernel wins depends on the CPU, the shape, the number of weights of that shape (do they stay in cache?)
and the rows of the step (benchmarks/NOTES.md, "SmolLM2"): oneDNN over a weight packed once into its blocked
layout streams a large weight fastest but costs ~10 us a call before reading a byte; MKL's plain F.linear wins
on small cache-resident weights with few rows; oneDNN packs bf16 weights only on CPUs with native bf16
conversions. So nothing here is a threshold: at load, `choose_kernels` times every candidate on the model's own
weights of each shape (all of them in turn, so that cache effects are those of a real step) at one row count
per bucket (1, 2-8, 9-32, more) and keeps the fastest per bucket. The choice is cached per machine in a JSON
file (`kernel_cache_path`) keyed by CPU model, torch version, threads, dtype and shape.

Candidates only ever compute the same product: in bf16 they must give the same bits as F.linear on a probe (so
a verify step's rows are the rows plain decoding would produce), in fp32 the same sums to rounding; an int8
or int4 weight has a single kernel (the native one where the CPU runs it). Packing is a module swap done by the engine after loading; training never sees it.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

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
    return ["linear", "packed"] if can_pack(device, dtype) else ["linear"]


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
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_cache_path() -> Path | None:
    """$SPECSERVE_KERNEL_CACHE (empty: no cache), else the user cache dir's specserve/kernels.json."""
    env = os.environ.get("SPECSERVE_KERNEL_CACHE")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specserve" / "kernels.json"


def machine_key() -> str:
    return (f"{cpu_name()} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads")


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
    first weight), and they must give the same bits as each other, so that mixing them across buckets is
    exact too. Only then does speed choose."""
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
    ref_name = next(iter(kernels))
    ref = kernels[ref_name][0](probe)
    for n in list(kernels)[1:]:
        if not torch.equal(ref, kernels[n][0](probe)):
            logger.info("kernel %s: not the same bits as %s on this CPU; not used", n, ref_name)
            del kernels[n]
    choice, timings = [], []
    for rows in BUCKET_ROWS:
        seconds = time_kernels(kernels, torch.randn(rows, weights[0].shape[1]).to(dtype))
        choice.append(min(seconds, key=seconds.get))
        timings.append({n: round(s * 1e6, 1) for n, s in seconds.items()})
    cache[key] = {"choice": choice, "us": timings, "two_rows": {n: two_rows[n] for n in kernels}}
    return choice, kernels


def load_cache(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_cache(path: Path | None, cache: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not write the kernel cache %s: %s", path, e)


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
    return module
