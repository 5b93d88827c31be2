"""specserve command line: generate, serve, bench, tune, train."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from specserve.config import MAX_NUM_ASSISTANT_TOKENS, SPEC_METHODS


def non_negative_int(name: str, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}")
        if value < 0 or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{name} must be in [0, {maximum}], got {value}" if maximum is not None
                                             else f"{name} must be >= 0, got {value}")
        return value
    return parse


def positive_int(name: str):
    def parse(text: str) -> int:
        value = non_negative_int(name)(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value
    return parse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by generate and serve: the model, its memory, and the drafter."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV-cache budget (target + drafter)")
    p.add_argument("--max-model-len", type=positive_int("--max-model-len"), default=None)
    p.add_argument("--block-size", type=positive_int("--block-size"), default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--speculative-method", choices=SPEC_METHODS, default=None,
                   help="default: detected (a drafter in a subfolder of the model, MTP layers in it), else none")
    p.add_argument("--draft-model", default=None, help="folder of a draft model (or EAGLE3 head)")
    p.add_argument("--num-assistant-tokens", type=non_negative_int("--num-assistant-tokens", MAX_NUM_ASSISTANT_TOKENS),
                   default=None, help="draft tokens per step (default: generation_config.json, else 5)")
    p.add_argument("--prompt-lookup-min", type=positive_int("--prompt-lookup-min"), default=None)
    p.add_argument("--prompt-lookup-max", "--max-ngram-size", dest="prompt_lookup_max",
                   type=positive_int("--prompt-lookup-max"), default=None)
    p.add_argument("--branching-factor", type=positive_int("--branching-factor"), default=None)
    p.add_argument("--tree-depth", type=non_negative_int("--tree-depth"), default=None)
    p.add_argument("--no-ngram-cache", action="store_true", help="n-gram: no cross-request cache")


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(dtype=args.dtype, device=args.device, kv_cache_memory_gb=args.kv_cache_memory_gb,
                  max_model_len=args.max_model_len, block_size=args.block_size,
                  enable_prefix_caching=not args.no_prefix_caching, speculative_method=args.speculative_method,
                  draft_model=args.draft_model, num_assistant_tokens=args.num_assistant_tokens,
                  prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                  branching_factor=args.branching_factor, tree_depth=args.tree_depth,
                  ngram_cache=not args.no_ngram_cache)
    if args.model is not None:
        kwargs["model"] = args.model
    return kwargs


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate a completion offline")
    p.add_argument("--model", default=None, help="model folder (default: the shipped demo model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=positive_int("--max-tokens"), default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    if args.temperature < 0:
        raise SystemExit("error: --temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        raise SystemExit("error: --top-p must be in (0, 1]")
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    elapsed = time.perf_counter() - start
    completion = out.outputs[0]
    if args.json:
        print(json.dumps({
            "text": completion.text,
            "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "num_generated_tokens": len(completion.token_ids),
            "tokens_per_second": out.decode_tokens_per_second,
            "ttft_s": out.ttft_s,
            "elapsed_s": elapsed,
            "speculative_method": llm.engine.spec_method,
            "spec": out.spec,
        }))
    else:
        print(completion.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="LLM inference built around speculative decoding")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    from specserve.server.cli import add_serve_parser
    from specserve.bench.cli import add_bench_parsers
    from specserve.train.cli import add_train_parsers
    add_serve_parser(sub)
    add_bench_parsers(sub)
    add_train_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
