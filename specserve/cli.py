"""specserve command line: generate, convert, serve, bench, tune, train."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from specserve.cli_args import add_engine_arguments, engine_config_from_args, int_at_least
from specserve.config import DEFAULT_MODEL_NAME


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate a completion offline")
    p.add_argument("--model", default=None, help="Hugging Face model folder or GGUF file "
                   f"(default: {DEFAULT_MODEL_NAME}, drafting with n-gram lookup)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int_at_least(1), default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_arguments(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    if args.temperature < 0:
        raise SystemExit("error: --temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        raise SystemExit("error: --top-p must be in (0, 1]")
    from specserve.distributed.worker import run_torchrun_worker
    config = engine_config_from_args(args)
    if run_torchrun_worker(config):         # under torchrun, ranks above 0 serve rank 0's calls
        return 0
    llm = LLM(**dataclasses.asdict(config))
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


def add_convert_parser(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a GGUF file into a Hugging Face model folder",
                              description="Dequantize a GGUF file (llama, qwen2, qwen3) and write config.json, "
                                          "model.safetensors, tokenizer.json, tokenizer_config.json and "
                                          "generation_config.json.")
    p.add_argument("gguf_file", metavar="FILE.gguf")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of the written weights (default: bfloat16)")
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from specserve.gguf.convert import convert
    from specserve.models.registry import parse_dtype
    start = time.perf_counter()
    out = convert(args.gguf_file, args.out_dir, parse_dtype(args.dtype))
    print(f"wrote {out} ({args.dtype}) in {time.perf_counter() - start:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="LLM inference built around speculative decoding")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_convert_parser(sub)
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
