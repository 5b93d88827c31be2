"""Plain decode tokens/s: specserve vs transformers' generate, same random Qwen3 checkpoint, batch 1,
greedy, 128 new tokens, side by side in one run. Prints a table with the ratio.

    python benchmarks/bench_decode.py [--sizes small,large] [--dtypes float32,bfloat16] [--repeats 3]

Both engines run on the same threads (--threads, default: all cores) and in the same dtype.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_checkpoint  # noqa: E402

SIZES = {"small": dict(hidden=256, layers=4, vocab_size=8192),
         "large": dict(hidden=768, layers=12, vocab_size=32000)}
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def transformers_runner(model_dir: Path, ids: list[int], new_tokens: int, dtype: torch.dtype):
    """A function that times one greedy generate of new_tokens tokens and returns tokens/s."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    x = torch.tensor([ids])
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    @torch.inference_mode()
    def run() -> float:
        start = time.perf_counter()
        model.generate(x, **kw)
        return new_tokens / (time.perf_counter() - start)
    with torch.inference_mode():
        model.generate(x, max_new_tokens=8, do_sample=False)          # warm-up
    return run


def specserve_runner(model_dir: Path, ids: list[int], new_tokens: int, dtype: str):
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    llm = LLM(str(model_dir), dtype=dtype, speculative_method="none", kv_cache_memory_gb=0.25,
              num_threads=torch.get_num_threads(), enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def run() -> float:
        out = llm.generate([ids], params)[0]
        # whole-request rate, prefill included, like the transformers timing above
        return new_tokens / (out.ttft_s + out.decode_s)
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))   # warm-up
    return run


def profile_specserve(run, new_tokens: int) -> None:
    """Where a decode step's time goes, in one run of specserve_runner's engine: torch's operator profile
    plus the Python share around it."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    op_total = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"\nprofile of {new_tokens} decode steps: wall {wall * 1e3:.0f} ms (profiled), "
          f"torch operators {op_total * 1e3:.0f} ms, the rest (Python, scheduling, sampling glue) "
          f"{(wall - op_total) * 1e3:.0f} ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also print where specserve's decode time goes")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="for both engines")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    rows = []
    for name in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as d:
            model_dir = make_checkpoint(Path(d), "qwen3", **SIZES[name])
            n_params = sum(p.numel() for p in __import__("safetensors.torch").torch.load_file(
                str(model_dir / "model.safetensors")).values())
            from specserve.tokenizer import Tokenizer
            ids = Tokenizer.from_pretrained(model_dir).encode(PROMPT)
            for dtype in dtypes:
                tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
                hf_run = transformers_runner(model_dir, ids, args.new_tokens, tdtype)
                our_run = specserve_runner(model_dir, ids, args.new_tokens, dtype)
                # interleaved, so that a change in the machine's load hits both engines alike
                pairs = [(hf_run(), our_run()) for _ in range(args.repeats)]
                hf, ours = max(p[0] for p in pairs), max(p[1] for p in pairs)
                rows.append((name, n_params / 1e6, dtype, hf, ours, statistics.median(o / h for h, o in pairs)))
                if args.profile:
                    profile_specserve(our_run, args.new_tokens)
    print(f"\nplain greedy decode, batch 1, {args.new_tokens} new tokens, {args.threads} thread(s), {args.repeats} "
          f"interleaved runs each: best tok/s, their ratio, and the median of the runs' ratios")
    print("| model | params (M) | dtype | transformers tok/s | specserve tok/s | ratio of best | median ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, n, dtype, hf, ours, median in rows:
        print(f"| {name} | {n:.1f} | {dtype} | {hf:.0f} | {ours:.0f} | {ours / hf:.2f}x | {median:.2f}x |")


if __name__ == "__main__":
    main()
