"""One decode row's attention on CPU, per layer, at the default model's shape (3 K/V heads, 3 query heads each,
head_dim 64): the kernel attend_row_by_row uses against the alternatives, at several context lengths.

    python benchmarks/bench_attention.py [--lengths 200,1000,4000] [--threads 1] [--repeats 9]

Each candidate reads its own 30-layer head-major cache ([L, 2, Hkv, S, D], as model_runner.py stores it) one
layer after another, so that at long contexts the K/V come from memory as in a real decode step, not from
cache. The candidates are interleaved (A B C A B C ...) and the best of --repeats is kept.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specserve.layers.attention import attend_one_row, quantize_kv
from specserve.layers.kernels import attend_row_native

LAYERS, HKV, G, D = 30, 3, 3, 64


def sdpa(query, keys, values):                       # torch's SDPA in the cache's dtype
    return F.scaled_dot_product_attention(query.to(keys.dtype)[None], keys[None], values[None])[0]


def sdpa_fp32(query, keys, values):                  # over the slots upcast to fp32
    return F.scaled_dot_product_attention(query.float()[None], keys.float()[None], values.float()[None])[0]


def bf16_products(query, keys, values):              # what attend_one_row does past BF16_PRODUCTS_MIN_SLOTS
    scores = torch.matmul(keys, query.transpose(1, 2)).transpose(1, 2).float().mul_(D ** -0.5)
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


def fp32_scores(query, keys, values):                # K upcast: fp32 scores, then bf16 probabilities times V
    scores = torch.matmul(keys.float(), query.float().transpose(1, 2)).transpose(1, 2).mul_(D ** -0.5)
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


CANDIDATES = {                                        # name: (kernel, cache dtype)
    "fp32 cache, SDPA": (sdpa, torch.float32),
    "bf16 cache, SDPA": (sdpa, torch.bfloat16),
    "bf16 cache, fp32 SDPA over upcast": (sdpa_fp32, torch.bfloat16),
    "bf16 cache, fp32 scores": (fp32_scores, torch.bfloat16),
    "bf16 cache, bf16 products": (bf16_products, torch.bfloat16),
    "bf16 cache, native kernel (attend_row.c)": (attend_row_native, torch.bfloat16),
    "bf16 cache, attend_one_row (now)": (attend_one_row, torch.bfloat16),
    "int8 cache, native kernel": (attend_row_native, torch.int8),       # --kv-cache-dtype int8
}


def make_cache(T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A 30-layer head-major cache of random K/V, and its scales for an int8 one (quantize_kv)."""
    kv = torch.randn(LAYERS, 2, HKV, T, D)
    if dtype != torch.int8:
        return kv.to(dtype), None
    return quantize_kv(kv.bfloat16())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="200,1000,4000")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s); us per layer for one decode row")
    print("| slots | " + " | ".join(CANDIDATES) + " |")
    print("|---|" + "---|" * len(CANDIDATES))
    query = torch.randn(HKV, G, D).bfloat16()
    for T in (int(n) for n in args.lengths.split(",")):
        caches = {name: make_cache(T, dtype) for name, (_, dtype) in CANDIDATES.items()}
        best = dict.fromkeys(CANDIDATES, float("inf"))
        for _ in range(args.repeats):
            for name, (kernel, _) in CANDIDATES.items():
                cache, scales = caches[name]
                start = time.perf_counter()
                for layer in range(LAYERS):
                    if scales is None:
                        kernel(query, cache[layer, 0], cache[layer, 1])
                    else:
                        kernel(query, cache[layer, 0], cache[layer, 1], scales=(scales[layer, 0], scales[layer, 1]))
                best[name] = min(best[name], (time.perf_counter() - start) / LAYERS)
        print(f"| {T} | " + " | ".join(f"{best[name] * 1e6:.0f}" for name in CANDIDATES) + " |", flush=True)


if __name__ == "__main__":
    main()
