"""Command-line flags shared by `specserve generate` and `specserve serve`: the engine and the drafter.

Every flag defaults to None, so that a caller can tell "not given" from a value; EngineConfig's own
defaults apply to what stays None.
"""
from __future__ import annotations

import argparse
import dataclasses

from specserve.config import MAX_NUM_ASSISTANT_TOKENS, SPEC_METHODS, EngineConfig

ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}


def int_at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def default(name: str, extra: dict | None = None) -> str:
    value = (extra or {}).get(name, ENGINE_DEFAULTS.get(name))
    return f" (default: {value})" if value is not None else ""


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    engine = p.add_argument_group("engine")
    engine.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations dtype; auto: the checkpoint's on CUDA, on CPU bfloat16 for a "
                             "bfloat16 checkpoint (where oneDNN supports it), else float32")
    engine.add_argument("--quantization", choices=["int8", "int4"],
                        help="weight-only int8 (per row) or int4 (groups of 32) linears on CPU, quantized at load "
                             "(default: none)")
    engine.add_argument("--device", help="cpu, cuda, cuda:N or auto" + default("device"))
    engine.add_argument("--max-num-seqs", type=int_at_least(1), help="requests batched at once" + default("max_num_seqs"))
    engine.add_argument("--max-num-batched-tokens", type=int_at_least(1),
                        help="tokens per engine step" + default("max_num_batched_tokens"))
    engine.add_argument("--max-model-len", type=int_at_least(2),
                        help="context length (default: the model's max_position_embeddings)")
    engine.add_argument("--kv-cache-memory-gb", type=positive_float,
                        help="memory for all KV caches, target and drafter" + default("kv_cache_memory_gb"))
    engine.add_argument("--block-size", type=int_at_least(1), help="tokens per KV block" + default("block_size"))
    engine.add_argument("--no-prefix-caching", action="store_true", default=None, help="turn prefix caching off")
    engine.add_argument("--seed", type=int, help="seed for requests without one" + default("seed"))
    engine.add_argument("--num-threads", type=int_at_least(1),
                        help="CPU threads (default: 1 for models whose weights fit in cache, else all cores)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=SPEC_METHODS,
                      help="default: detected (a drafter in a subfolder of the model folder, else none; "
                           "the default model: ngram)")
    spec.add_argument("--draft-model", metavar="PATH", help="drafter folder; its kind is read from its config.json")
    spec.add_argument("--num-assistant-tokens", type=int_at_least(0, MAX_NUM_ASSISTANT_TOKENS),
                      help="draft tokens per step, for requests that do not set it (default: generation_config.json, else 5)")
    spec.add_argument("--prompt-lookup-min", type=int_at_least(1), help="smallest n-gram matched (ngram)")
    spec.add_argument("--prompt-lookup-max", "--max-ngram-size", type=int_at_least(1), help="largest n-gram matched (ngram)")
    spec.add_argument("--branching-factor", type=int_at_least(1), help="children per tree node (tree drafting)")
    spec.add_argument("--tree-depth", type=int_at_least(0), help="draft tree depth; 0 drafts a chain")
    spec.add_argument("--no-ngram-cache", action="store_true", default=None,
                      help="ngram: match only the request's own tokens, not earlier requests'")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = set(EngineConfig.__slots__) - {"model", "enable_prefix_caching", "ngram_cache"}
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if args.model is not None:
        kwargs["model"] = args.model
    return EngineConfig(enable_prefix_caching=not args.no_prefix_caching, ngram_cache=not args.no_ngram_cache, **kwargs)
