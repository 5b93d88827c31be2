"""`specserve bench serve`: send prompts to an OpenAI-compatible server at a set rate, measure, print vLLM's block."""
import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from specserve.bench.client import RequestInput, RequestFuncOutput, fetch_spec_counters, first_model, send_request
from specserve.bench.datasets import (SampleRequest, TokenizerLike, default_sonnet_path, load_jsonl_prompts,
                                      load_sonnet, sample_jsonl, sample_random, sample_sonnet)
from specserve.bench.metrics import (BenchmarkMetrics, SpecDecodeStats, calculate_metrics, format_result,
                                     result_dict, spec_decode_stats)

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
HTTP_TIMEOUT_S = 6 * 60 * 60


@dataclass(slots=True)
class LoadConfig:
    """Where to send and how hard: everything about a run except its prompts."""
    base_url: str
    endpoint: str
    model: str
    chat: bool = False
    request_rate: float = float("inf")       # requests/s; inf sends everything at once
    burstiness: float = 1.0                  # 1 = Poisson arrivals; gaps are gamma(burstiness) otherwise
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float | None = None
    ignore_eos: bool = False
    extra_body: dict | None = None
    num_warmups: int = 0
    show_progress: bool = True
    percentiles: tuple[float, ...] = (99.0,)


@dataclass(slots=True)
class BenchResult:
    metrics: BenchmarkMetrics
    spec: SpecDecodeStats | None
    outputs: list[RequestFuncOutput] = field(repr=False)


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (s) from the start, drawn as vLLM draws them after `np.random.seed(seed)`: gamma gaps
    (exponential, i.e. Poisson arrivals, at burstiness 1), rescaled so the last goes out at num_requests / rate."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if burstiness == float("inf"):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.RandomState(seed)
        gaps = np.array([rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness))
                         for _ in range(num_requests)])
    times = np.cumsum(gaps)
    return (times * (num_requests / request_rate / times[-1])).tolist()


async def benchmark(cfg: LoadConfig, samples: list[SampleRequest],
                    count_tokens: Callable[[str], int] | None = None) -> BenchResult:
    """Duration runs from the start of dispatch to the last completion; spec counters are read around it."""
    inputs = [RequestInput(cfg.base_url + cfg.endpoint, cfg.model, s.prompt, s.prompt_len, s.expected_output_len,
                           cfg.chat, cfg.temperature, cfg.ignore_eos, cfg.extra_body) for s in samples]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, limits=limits) as client:
        semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()

        async def limited(req: RequestInput, pbar: tqdm | None = None) -> RequestFuncOutput:
            async with semaphore:
                return await send_request(client, req, pbar)

        if cfg.num_warmups > 0:
            print(f"Warming up with {cfg.num_warmups} requests...")
            await asyncio.gather(*(limited(inputs[0]) for _ in range(cfg.num_warmups)))
        before = await fetch_spec_counters(client, cfg.base_url)
        pbar = tqdm(total=len(inputs), disable=not cfg.show_progress)
        tasks = []
        start = time.perf_counter()
        for req, offset in zip(inputs, arrival_times(len(inputs), cfg.request_rate, cfg.burstiness, cfg.seed)):
            if (delay := start + offset - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(req, pbar)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        pbar.close()
        after = await fetch_spec_counters(client, cfg.base_url)
    metrics = calculate_metrics(outputs, duration, cfg.percentiles, count_tokens)
    return BenchResult(metrics, spec_decode_stats(before, after), outputs)


# --- from command-line arguments ---


def base_url_of(args: argparse.Namespace) -> str:
    return args.base_url.rstrip("/") if args.base_url else f"http://{args.host}:{args.port}"


def backend_and_endpoint(args: argparse.Namespace) -> tuple[str, str]:
    """Either flag implies the other; neither gives vLLM's default, openai on /v1/completions."""
    backend = args.backend or ("openai-chat" if (args.endpoint or "").endswith("/chat/completions") else "openai")
    return backend, args.endpoint or ENDPOINTS[backend]


async def resolve_model(base_url: str, model: str | None, served_model_name: str | None) -> tuple[str, str | None]:
    """The name to send, and the server's path for it if known. A local directory as --model is asked for by
    the name the server lists, since servers name models differently."""
    if served_model_name:
        return served_model_name, None
    if model and not Path(model).is_dir():
        return model, None
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            return await first_model(client, base_url)
        except httpx.TransportError as e:
            raise ConnectionError(f"cannot reach the server at {base_url} ({e!r}); is it running?") from None


def tokenizer_dir(tokenizer: str | None, model: str | None, server_root: str | None) -> Path:
    """--tokenizer, else --model or the server's model path when a local directory, else the demo model."""
    if tokenizer:
        return Path(tokenizer)
    for candidate in (model, server_root):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    from specserve.config import default_model_dir
    return Path(default_model_dir())


def load_tokenizer(path: Path) -> TokenizerLike:
    from specserve.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(path)


def build_samples(args: argparse.Namespace, tokenizer: TokenizerLike, chat: bool) -> list[SampleRequest]:
    """Chat requests carry the raw prompt (the server applies the template); completions get it formatted."""
    if args.dataset_name == "sonnet":
        path = args.dataset_path or default_sonnet_path()
        return sample_sonnet(load_sonnet(path), tokenizer, args.num_prompts,
                             input_len=args.input_len or args.sonnet_input_len,
                             output_len=args.output_len or args.sonnet_output_len,
                             prefix_len=args.sonnet_prefix_len, seed=args.seed, return_prompt_formatted=not chat)
    if args.dataset_name == "random":
        return sample_random(tokenizer, args.num_prompts, input_len=args.input_len or args.random_input_len,
                             output_len=args.output_len or args.random_output_len,
                             prefix_len=args.random_prefix_len, range_ratio=args.random_range_ratio, seed=args.seed)
    return sample_jsonl(load_jsonl_prompts(args.dataset_path), tokenizer, args.num_prompts,
                        output_len=args.output_len or 256, return_prompt_formatted=not chat)


async def prepare(args: argparse.Namespace, base_url: str) -> tuple[LoadConfig, list[SampleRequest], TokenizerLike]:
    backend, endpoint = backend_and_endpoint(args)
    model, server_root = await resolve_model(base_url, args.model, args.served_model_name)
    tokenizer = load_tokenizer(tokenizer_dir(args.tokenizer, args.model, server_root))
    samples = build_samples(args, tokenizer, backend == "openai-chat")
    cfg = LoadConfig(base_url, endpoint, model, backend == "openai-chat", args.request_rate, args.burstiness,
                     args.max_concurrency, args.seed, args.temperature, args.ignore_eos, args.extra_body,
                     args.num_warmups, not args.disable_tqdm, args.metric_percentiles)
    return cfg, samples, tokenizer


def print_failures(outputs: list[RequestFuncOutput], limit: int = 10) -> None:
    failed = [out for out in outputs if not out.success]
    if failed:
        print(f"Failed requests during benchmark run detected (capping to {limit}):")
        for i, out in enumerate(failed[:limit]):
            print(f"Error {i}: {out.error}")


async def serve_async(args: argparse.Namespace) -> dict:
    cfg, samples, tokenizer = await prepare(args, base_url_of(args))
    print(f"Traffic request rate: {cfg.request_rate}")
    distribution = "Poisson process" if cfg.burstiness == 1.0 else "Gamma distribution"
    print(f"Burstiness factor: {cfg.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {cfg.max_concurrency}")
    result = await benchmark(cfg, samples, lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    print_failures(result.outputs)
    print(format_result(result.metrics, result.spec, cfg.max_concurrency, cfg.request_rate, args.percentile_metrics))
    saved = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if cfg.chat else "openai",
             "endpoint": cfg.endpoint, "model_id": cfg.model, "dataset_name": args.dataset_name,
             "num_prompts": args.num_prompts, "max_concurrency": cfg.max_concurrency,
             "request_rate": cfg.request_rate if cfg.request_rate < float("inf") else "inf",
             "burstiness": cfg.burstiness, "extra_body": cfg.extra_body,
             **result_dict(result.metrics, result.spec, result.outputs)}
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(saved, indent=2))
        print(f"Saved the result to {args.save_result}")
    return saved


def run_serve(args: argparse.Namespace) -> dict:
    return asyncio.run(serve_async(args))
