"""Native CPU kernels: C sources beside this file, compiled once per machine by the system's C compiler
(`cc -O3 -march=native -fopenmp`), cached by source, compiler and CPU, and called through ctypes (which
releases the GIL). They link the OpenMP runtime torch has loaded, so they share its threads.

Where no compiler is found, the CPU lacks what a kernel needs (AVX-512 for attend_row.c, AVX512-VNNI for a8_linear.c,
AVX512-BF16 for bf16_linear.c) or SPECSERVE_NATIVE_KERNELS=0, the loader returns None and callers keep their torch
path."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specserve.gguf.cache import cache_dir

logger = logging.getLogger(__name__)
SOURCES = Path(__file__).resolve().parent


def enabled() -> bool:
    return os.environ.get("SPECSERVE_NATIVE_KERNELS", "1") != "0"


def cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def load(name: str, *extra_flags: str) -> ctypes.CDLL | None:
    """The compiled `name`.c, building it first if this machine has not; None where it cannot be built.
    extra_flags: more compiler flags (a test builds the kernel as a CPU without some extension would)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("no C compiler: the native %s kernel is off", name)
        return None
    source = SOURCES / f"{name}.c"
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *extra_flags]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), version, cpu_flags(), *flags]).encode()).hexdigest()[:16]
    built = cache_dir() / "kernels" / f"{name}-{key}.so"
    try:
        if not built.is_file():
            built.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=built.parent) as tmp:
                out = Path(tmp) / built.name
                run = subprocess.run([compiler, *flags, str(source), "-o", str(out), "-lm"], capture_output=True,
                                     text=True, timeout=300)
                if run.returncode != 0:
                    logger.warning("the native %s kernel did not build; torch is used instead:\n%s",
                                   name, run.stderr[-2000:])
                    return None
                os.replace(out, built)              # atomic: another process may be building the same file
        return ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("the native %s kernel is off: %s", name, e)
        return None


@functools.cache
def attend_row_library(*extra_flags: str) -> ctypes.CDLL | None:
    if not enabled() or "avx512f" not in cpu_flags().split():
        return None
    lib = load("attend_row", *extra_flags)
    if lib is not None:
        lib.attend_row.restype = ctypes.c_int
        lib.attend_row.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 4 + [ctypes.c_int] * 4 + \
            [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        lib.attend_chains.restype = ctypes.c_int
        lib.attend_chains.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + \
            [ctypes.c_void_p, ctypes.c_long] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_int] * 3 + \
            [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


@functools.cache
def a8_linear_library() -> ctypes.CDLL | None:
    """kernels/a8_linear.c, on CPUs with AVX512-VNNI (and the AVX-512 subsets it uses)."""
    if not enabled() or not {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(cpu_flags().split()):
        return None
    lib = load("a8_linear")
    if lib is not None:
        lib.a8_linear.restype = ctypes.c_int
        lib.a8_linear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 5 + \
            [ctypes.c_int] * 4
    return lib


@functools.cache
def bf16_linear_library() -> tuple[ctypes.CDLL | None, bool]:
    """kernels/bf16_linear.c on CPUs with AVX512-BF16, and whether its AMX path may run (the CPU has AMX-BF16
    and Linux granted the process its tile data)."""
    if not enabled() or not {"avx512f", "avx512bw", "avx512_bf16"} <= set(cpu_flags().split()):
        return None, False
    lib = load("bf16_linear")
    if lib is None:
        return None, False
    lib.bf16_linear.restype = ctypes.c_int
    lib.bf16_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    amx = {"amx_tile", "amx_bf16"} <= set(cpu_flags().split()) and lib.bf16_amx_init() == 0
    return lib, amx


NATIVE_CACHE_DTYPES = (torch.bfloat16, torch.int8)


def attend_row_native(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor | None = None,
                      scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """query [Hkv, G, D] bf16, keys/values [Hkv, T, D] on CPU, rows contiguous (any head and row strides, the
    same for K and V) -> [Hkv, G, D] bf16. keys/values are bf16, or int8 with `scales`: fp32 [Hkv, T] for K and
    for V, slots contiguous. With `slots` (int64 [T]), keys/values (and scales) span a layer's whole cache
    ([Hkv, S, D], [Hkv, S]) and row t is row slots[t]: the context read where it lies. None where the kernel is
    off."""
    if keys.dtype not in NATIVE_CACHE_DTYPES or keys.device.type != "cpu":  # first: the cheap test fp32 models fail
        return None
    lib = attend_row_library()
    Hkv, _, D = keys.shape
    if lib is None or query.dtype != torch.bfloat16 or values.dtype != keys.dtype or keys.stride(2) != 1 \
            or keys.stride()[1:] != values.stride()[1:] or not query.is_contiguous() \
            or (keys.dtype == torch.int8) != (scales is not None):
        return None
    ks, vs = (None, None) if scales is None else scales
    if ks is not None and (ks.stride(1) != 1 or vs.stride() != ks.stride()):
        return None
    if slots is not None and (slots.dtype != torch.int64 or not slots.is_contiguous()):
        slots = slots.to(torch.int64).contiguous()
    out = torch.empty_like(query)
    status = lib.attend_row(query.data_ptr(), keys.data_ptr(), values.data_ptr(), None if ks is None else ks.data_ptr(),
                            None if vs is None else vs.data_ptr(), None if slots is None else slots.data_ptr(), keys.stride(0),
                            values.stride(0), keys.stride(1), 0 if ks is None else ks.stride(0), Hkv, query.shape[1],
                            keys.shape[1] if slots is None else len(slots), D, D ** -0.5, out.data_ptr(),
                            torch.get_num_threads())
    return out if status == 0 else None


def attend_chains_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                         scales: torch.Tensor | None, seqs: int, num_seqs: int, slots: int, num_threads: int
                         ) -> torch.Tensor | None:
    """Attends every row q [N, Hq, D] over its prefix in one layer's cache [S, 2, Hkv, D] (a view of head-major
    storage), each as attend_row_native attends it alone -> [N, Hq, D]. k/v [N, Hkv, D] are written into it first:
    as they are (bf16), or quantized (int8, with `scales`: [S, 2, Hkv] over head-major storage).
    seqs: the address of an int64 [num_seqs, 5] array: per sequence its first row, rows, cached tokens, first
    slot of its context when that is one run (else -1) and the offset of its context's slot numbers in the
    int64 array at `slots`. Called once a layer, so it checks only what the plan cannot know (the products'
    layout); None where the layout is not one it reads (the caller then takes attend_row_by_row)."""
    lib, D = attend_row_library(), q.shape[-1]
    if lib is None or q.dtype != torch.bfloat16 or q.stride()[1:] != (D, 1) or k.stride()[1:] != (D, 1) \
            or v.stride()[1:] != (D, 1) or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return None
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    base, element = cache.data_ptr(), cache.element_size()
    ks = vs = None
    if scales is not None:
        ks = scales.data_ptr()
        vs = ks + scales.stride(1) * 4
    status = lib.attend_chains(
        seqs, num_seqs, slots, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), base,
        base + element * cache.stride(1), ks, vs, cache.stride(2), 0 if scales is None else scales.stride(2),
        k.shape[1], q.shape[1] // k.shape[1], D, D ** -0.5, out.data_ptr(), num_threads)
    return out if status == 0 else None
