"""Plain decode tokens/s: specserve vs transformers' generate on the same weights, side by side in one run.

    python benchmarks/bench_decode.py [--sizes small,large] [--dtypes float32,bfloat16] [--repeats 3]
    python benchmarks/bench_decode.py --model-dir /tmp/smollm2-hf --sizes '' [--quantizations none,int8,int4]
        [--compile] [--kv-cache-dtypes auto,int8] [--openvino-python VENV/bin/python --openvino-models OV1,OV2]
        [--llama-server BUILD/bin/llama-server --llama-models FILE1.gguf,FILE2.gguf]

Random Qwen3 checkpoints (--sizes): batch 1, greedy, 128 new tokens after one code prompt. A real model
(--model-dir, e.g. the default SmolLM2-135M-Instruct converted to a bf16 HF folder): 12 chat prompts (code and
prose, its chat template applied), 128 new tokens each, greedy, EOS ignored, batch 1; transformers in bf16,
specserve in bf16 and with each --quantizations; then, in the same run, the machine's read bandwidth (the
ceiling it sets on tokens/s), the cost of a 6-token verify step against a 1-token step, and decode speed at a
4,000-token context against a 200-token one. Both engines run on the same threads (--threads, default all).
Runs are interleaved so that a change in the machine's load hits every engine alike. With --openvino-python,
OpenVINO GenAI runs the same templated prompts too, one row per exported folder in --openvino-models, each in
its own worker process (openvino_worker.py) that waits between rounds. With --llama-server, llama.cpp's server
runs them too, one row per GGUF file in --llama-models (the same token ids, sent to /completion; each request
timed whole, as for the other engines).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_checkpoint  # noqa: E402

from specserve.layers.kernels import attend_row_library  # noqa: E402

SIZES = {"small": dict(hidden=256, layers=4, vocab_size=8192),
         "large": dict(hidden=768, layers=12, vocab_size=32000)}
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
CHAT_PROMPTS = [                                    # code and prose alternate: --prompts N keeps both kinds
    "Write a Python function that reverses a singly linked list, with a short docstring.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain what a Python decorator is and show a small example that times a function.",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Give me five tips for getting better sleep, with one sentence on why each works.",
    "Implement binary search in JavaScript and explain its time complexity.",
    "Summarize the causes of the French Revolution in one paragraph.",
    "Write a bash script that counts the lines of every .py file in a directory tree.",
    "Write a polite email asking a colleague to review my pull request by Friday.",
    "Show how to read a CSV file with pandas and compute the mean of one column.",
    "Describe the water cycle and the role the sun plays in it.",
]


def transformers_runner(model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype):
    """A function that times one greedy generate of new_tokens tokens per prompt and returns tokens/s."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    @torch.inference_mode()
    def run() -> float:
        start = time.perf_counter()
        for ids in prompts:
            model.generate(torch.tensor([ids]), **kw)
        return len(prompts) * new_tokens / (time.perf_counter() - start)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)          # warm-up
    return run


def openvino_runner(python: str, ov_dir: str, prompts: list[str], new_tokens: int):
    """A function that asks a waiting OpenVINO GenAI worker for one round of the prompts and returns its tok/s."""
    worker = subprocess.Popen([python, str(Path(__file__).with_name("openvino_worker.py")), ov_dir,
                               str(torch.get_num_threads()), str(new_tokens)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker.stdin.write(json.dumps(prompts) + "\n")
    worker.stdin.flush()
    if worker.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the OpenVINO worker for {ov_dir} did not start (exit {worker.wait()})")

    def run() -> float:
        worker.stdin.write("round\n")
        worker.stdin.flush()
        return float(worker.stdout.readline())
    return run


def llama_server_runner(server: str, gguf: str, prompts: list[list[int]], new_tokens: int):
    """A function that sends each prompt's token ids to a llama-server on this model, one at a time, and returns
    the generated tokens per second of wall time (prompt processing included)."""
    import atexit
    import httpx

    from specserve.bench.launch import free_port, wait_until_healthy
    port, log = free_port(), Path(tempfile.mkdtemp()) / "llama-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([server, "-m", gguf, "--threads", str(torch.get_num_threads()), "--ctx-size",
                                 "4096", "--parallel", "1", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    atexit.register(proc.terminate)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, proc, 120, log)
    body = dict(n_predict=new_tokens, ignore_eos=True, temperature=0, top_k=1, cache_prompt=False)

    def run() -> float:
        start, tokens = time.perf_counter(), 0
        for ids in prompts:
            reply = httpx.post(f"{url}/completion", json=dict(body, prompt=ids), timeout=600).json()
            tokens += reply["tokens_predicted"]
        return tokens / (time.perf_counter() - start)
    httpx.post(f"{url}/completion", json=dict(body, prompt=prompts[0], n_predict=8), timeout=600)   # warm-up
    return run


def specserve_llm(model_dir: Path, dtype: str, quantization: str | None = None, compile: bool = False,
                  kv_cache_dtype: str = "auto"):
    from specserve.llm import LLM
    extra = {"quantization": quantization} if quantization else {}
    return LLM(str(model_dir), dtype=dtype, speculative_method="none", kv_cache_memory_gb=0.5,
               num_threads=torch.get_num_threads(), enable_prefix_caching=False, compile=compile,
               kv_cache_dtype=kv_cache_dtype, **extra)


def specserve_runner(llm, prompts: list[list[int]], new_tokens: int):
    from specserve.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def run() -> float:
        elapsed = 0.0
        for ids in prompts:                   # batch 1: one request at a time
            out = llm.generate([ids], params)[0]
            elapsed += out.ttft_s + out.decode_s     # whole-request time, prefill included, like transformers'
        return len(prompts) * new_tokens / elapsed
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8))   # warm-up
    return run


def profile_specserve(run, new_tokens: int) -> None:
    """Where a decode step's time goes, in one run of a specserve runner: torch's operator profile plus the
    Python share around it."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    op_total = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"\nprofile: wall {wall * 1e3:.0f} ms (profiled), torch operators {op_total * 1e3:.0f} ms, the rest "
          f"(Python, scheduling, sampling glue) {(wall - op_total) * 1e3:.0f} ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


def read_bandwidth() -> float:
    """GB/s of summing a 1 GiB tensor (far past any cache), best of 5, on the benchmark's threads."""
    x = torch.ones(1 << 28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step reads: every parameter and kernel buffer bar the embedding table (one
    row of it is read), the tied head counted once through its own copy."""
    from specserve.layers.linear import InferenceLinear
    total = 0
    for m in model.modules():
        if isinstance(m, InferenceLinear):
            kernel = m.by_bucket[0]
            tensors = [v for v in getattr(kernel, "keywords", {}).values() if isinstance(v, torch.Tensor)]
            tensors += [v for v in getattr(kernel, "__dict__", {}).values() if isinstance(v, torch.Tensor)]
            tensors += [c.cell_contents for c in (getattr(kernel, "__closure__", None) or ())
                        if isinstance(c.cell_contents, torch.Tensor)]
            total += sum(t.numel() * t.element_size() for t in tensors)
    for name, p in model.named_parameters():
        if "embed_tokens" not in name and ("norm" in name):
            total += p.numel() * p.element_size()
    return total


def step_costs(llm, context: int = 200, repeats: int = 30) -> tuple[float, float]:
    """Median seconds of a 1-token decode step and of a 6-token verify step (forward plus logits of every new
    row, as the engine's verification computes them), interleaved, at `context` tokens of cache."""
    from specserve.runtime.model_runner import ForwardItem
    runner, model = llm.engine.runner, llm.engine.model
    table = list(range(-(-(context + 8) // runner.block_size)))
    ids = [(i * 7919) % 1000 + 100 for i in range(context + 6)]
    one, six = [], []
    with torch.inference_mode():
        runner.forward([ForwardItem(table, 0, ids[:context])])
        for _ in range(repeats + 2):
            for n, out in ((1, one), (6, six)):
                start = time.perf_counter()
                hidden, _ = runner.forward([ForwardItem(table, context, ids[context:context + n])])
                model.compute_logits(hidden).argmax(-1)
                out.append(time.perf_counter() - start)
    return statistics.median(one[2:]), statistics.median(six[2:])


def context_speed(llm, text_ids: list[int], contexts: tuple[int, ...], new_tokens: int = 48) -> list[float]:
    """Decode tokens/s (prefill excluded) after each context length, the lengths interleaved over 2 runs."""
    from specserve.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    best = [0.0] * len(contexts)
    for _ in range(2):
        for i, n in enumerate(contexts):
            best[i] = max(best[i], llm.generate([text_ids[:n]], params)[0].decode_tokens_per_second)
    return best


def real_model(args) -> None:
    from specserve.bench.datasets import default_sonnet_path
    from specserve.tokenizer import Tokenizer
    model_dir = Path(args.model_dir)
    tok = Tokenizer.from_pretrained(model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:args.prompts]]
    prompts = [tok.encode(text, add_special_tokens=False) for text in texts]
    bandwidth = read_bandwidth()
    runs = {"transformers bf16": transformers_runner(model_dir, prompts, args.new_tokens, torch.bfloat16)}
    for gguf in filter(None, args.llama_models.split(",")):
        runs[f"llama.cpp {Path(gguf).name}"] = llama_server_runner(args.llama_server, gguf, prompts, args.new_tokens)
    for ov_dir in filter(None, args.openvino_models.split(",")):
        runs[f"OpenVINO GenAI {Path(ov_dir).name}"] = openvino_runner(args.openvino_python, ov_dir, texts,
                                                                       args.new_tokens)
    llms = {}
    for q in args.quantizations.split(","):
        for compiled in (False, True) if args.compile else (False,):
            for kv in args.kv_cache_dtypes.split(","):
                name = "specserve bf16" + ("" if q == "none" else f" {q}") + (" --compile" if compiled else "") + \
                    ("" if kv == "auto" else f" --kv-cache-dtype {kv}")
                llms[name] = specserve_llm(model_dir, "bfloat16", None if q == "none" else q, compiled, kv)
                runs[name] = specserve_runner(llms[name], prompts, args.new_tokens)
    rates = {name: [] for name in runs}
    for i in range(args.repeats):
        for name, run in runs.items():
            rates[name].append(run())
            print(f"run {i + 1}: {name} {rates[name][-1]:.1f} tok/s", flush=True)
    hf = rates["transformers bf16"]
    print(f"\n{model_dir.name}: {len(prompts)} chat prompts, {args.new_tokens} new tokens each, greedy, EOS ignored, "
          f"batch 1, {torch.get_num_threads()} thread(s), {args.repeats} interleaved runs; CPU: "
          f"{cpu_label()}; read bandwidth {bandwidth:.1f} GB/s")
    print("| engine | tok/s (best) | median ratio vs transformers bf16 | weights read/token | bandwidth ceiling |")
    print("|---|---|---|---|---|")
    for name, r in rates.items():
        if name in llms:
            per_token = weight_bytes_per_token(llms[name].engine.model)
            extra = f"{per_token / 1e6:.0f} MB | {bandwidth * 1e9 / per_token:.0f} tok/s"
        else:
            extra = "- | -"
        ratio = statistics.median(o / h for o, h in zip(r, hf))
        print(f"| {name} | {max(r):.1f} | {ratio:.2f}x | {extra} |")
    text = tok.encode(default_sonnet_path().read_text() * 2, add_special_tokens=False)
    print("\n| engine | 1-token step ms | 6-token verify step ms | verify / step | decode tok/s at 200 | at 4000 | 4000 / 200 |")
    print("|---|---|---|---|---|---|---|")
    for name, llm in llms.items():
        one, six = step_costs(llm)
        short, long = context_speed(llm, text, (200, 4000))
        print(f"| {name} | {one * 1e3:.2f} | {six * 1e3:.2f} | {six / one:.2f}x | {short:.1f} | {long:.1f} | "
              f"{long / short:.2f}x |")
    first = next(iter(llms.values()))
    if attend_row_library() is not None:                # the same engine with torch's one-row attention
        os.environ["SPECSERVE_NATIVE_KERNELS"] = "0"
        attend_row_library.cache_clear()
        one, six = step_costs(first)
        short, long = context_speed(first, text, (200, 4000))
        print(f"| {next(iter(llms))}, torch attention (no native kernel) | {one * 1e3:.2f} | {six * 1e3:.2f} | "
              f"{six / one:.2f}x | {short:.1f} | {long:.1f} | {long / short:.2f}x |")
        del os.environ["SPECSERVE_NATIVE_KERNELS"]
        attend_row_library.cache_clear()
    runner = first.engine.runner
    if hasattr(runner, "contiguous_start"):           # the same engine gathering its context (the code before)
        runner.contiguous_start = lambda table, n: None
        short, long = context_speed(next(iter(llms.values())), text, (200, 4000))
        print(f"| {next(iter(llms))}, context gathered | - | - | - | {short:.1f} | {long:.1f} | {long / short:.2f}x |")
    if args.profile:
        profile_specserve(runs[next(iter(llms))], args.new_tokens)


def cpu_label() -> str:
    import platform
    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 {'yes' if bf16 else 'no'}"


def random_models(args) -> None:
    rows = []
    for name in filter(None, args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as d:
            model_dir = make_checkpoint(Path(d), "qwen3", **SIZES[name])
            n_params = sum(p.numel() for p in __import__("safetensors.torch").torch.load_file(
                str(model_dir / "model.safetensors")).values())
            from specserve.tokenizer import Tokenizer
            ids = Tokenizer.from_pretrained(model_dir).encode(PROMPT)
            for dtype in args.dtypes.split(","):
                tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
                hf_run = transformers_runner(model_dir, [ids], args.new_tokens, tdtype)
                our_run = specserve_runner(specserve_llm(model_dir, dtype), [ids], args.new_tokens)
                pairs = [(hf_run(), our_run()) for _ in range(args.repeats)]
                hf, ours = max(p[0] for p in pairs), max(p[1] for p in pairs)
                rows.append((name, n_params / 1e6, dtype, hf, ours, statistics.median(o / h for h, o in pairs)))
                if args.profile:
                    profile_specserve(our_run, args.new_tokens)
    if not rows:
        return
    print(f"\nplain greedy decode, batch 1, {args.new_tokens} new tokens, {args.threads} thread(s), {args.repeats} "
          f"interleaved runs each: best tok/s, their ratio, and the median of the runs' ratios; CPU: {cpu_label()}")
    print("| model | params (M) | dtype | transformers tok/s | specserve tok/s | ratio of best | median ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, n, dtype, hf, ours, median in rows:
        print(f"| {name} | {n:.1f} | {dtype} | {hf:.0f} | {ours:.0f} | {ours / hf:.2f}x | {median:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,large", help="random Qwen3 models; '' for none")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    ap.add_argument("--model-dir", help="a real HF model folder with a chat template (e.g. SmolLM2 in bf16)")
    ap.add_argument("--quantizations", default="none,int8,int4", help="specserve variants on --model-dir")
    ap.add_argument("--compile", action="store_true", help="also each specserve variant with --compile")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="each specserve variant with each: auto, int8")
    ap.add_argument("--prompts", type=int, default=len(CHAT_PROMPTS), help="chat prompts used on --model-dir")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also print where specserve's decode time goes")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="for both engines")
    ap.add_argument("--openvino-python", help="a Python with openvino_genai installed")
    ap.add_argument("--openvino-models", default="", help="OpenVINO IR folders of --model-dir "
                    "(optimum-cli export openvino), each an extra row; needs --openvino-python")
    ap.add_argument("--llama-server", help="a llama.cpp llama-server binary")
    ap.add_argument("--llama-models", default="", help="GGUF files of the same model, each an extra row; needs "
                    "--llama-server")
    args = ap.parse_args()
    if args.openvino_models and not args.openvino_python:
        ap.error("--openvino-models needs --openvino-python")
    if args.llama_models and not args.llama_server:
        ap.error("--llama-models needs --llama-server")
    torch.set_num_threads(args.threads)
    random_models(args)
    if args.model_dir:
        real_model(args)


if __name__ == "__main__":
    main()
