"""Command-line flags shared by `specserve generate` and `specserve serve`: the engine and the drafter.

Every flag defaults to None, so that a caller can tell "not given" from a value; EngineConfig's own
defaults apply to what stays None.
"""
from __future__ import annotations

import argparse
import dataclasses

from specserve.config import SPEC_METHODS, EngineConfig
from specserve.drafting.factory import all_options, options_by_method
from specserve.drafting.options import AUTO, Option

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


def option_value(option: Option):
    """argparse type for a drafting option: its kind, its bounds, "auto" where it takes it."""
    def parse(text: str):
        try:
            value = text if option.auto and text == AUTO else option.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {option.kind.__name__}, got {text!r}") from None
        try:
            return option.check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
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
                        help="int8 or int4 linears on CPU, quantized at load in groups of 32 (int4 keeps the "
                             "output head int8); with AVX512-VNNI the activations are quantized to int8 too and "
                             "multiplied by integer dot products, else weight-only (default: none)")
    engine.add_argument("--kv-cache-dtype", choices=["auto", "int8"],
                        help="the target's KV cache: auto (the model's dtype) or int8 (a scale per token and head: "
                             "half the memory of bf16, and half the bytes attention reads at long contexts)"
                             + default("kv_cache_dtype"))
    engine.add_argument("--compile", action="store_true", default=None,
                        help="run the model's forward as torch.compile graphs (CPU; needs a C++ compiler): fewer, "
                             "fused ops a step; the first start compiles for about two minutes, later ones "
                             "reuse torch's cache")
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
    engine.add_argument("--tensor-parallel-size", "-tp", type=int_at_least(1),
                        help="shard the target over this many processes, one per device (gloo on CPU, NCCL on "
                             "CUDA); under torchrun, the number it started" + default("tensor_parallel_size"))
    engine.add_argument("--seed", type=int, help="seed for requests without one" + default("seed"))
    engine.add_argument("--num-threads", type=int_at_least(1),
                        help="CPU threads (default: 1 for models whose weights fit in cache, else all cores; serve "
                             "leaves one of them to its HTTP front end)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=SPEC_METHODS,
                      help="default: detected (a drafter in a subfolder of the model folder, else none; "
                           "the default model: ngram)")
    spec.add_argument("--draft-model", metavar="PATH", help="drafter folder; its kind is read from its config.json")
    for option in all_options():       # each method's own (drafting/options.py)
        owners = [m for m, options in options_by_method().items() if option in options]
        spec.add_argument(*(f"--{name.replace('_', '-')}" for name in (option.name, *option.aliases)),
                          dest=option.name, type=option_value(option),
                          help=f"{option.help}, for requests that do not set it ({', '.join(owners)}; default: "
                               f"generation_config.json, else {option.default})")
    spec.add_argument("--speculative-token-map", metavar="PATH",
                      help="draft, mtp: score draft tokens over the token ids in this file only (JSON list, or "
                           "SGLang's torch-saved tensor); 'none' for the whole vocabulary (default: the "
                           "drafter folder's token_map.json when it has one)")
    spec.add_argument("--speculative-catch-up-window", type=int_at_least(0), metavar="N",
                      help="eagle3, mtp: when drafting starts or resumes for a request, run the drafter over at most "
                           "its last N tokens, not its whole prompt or backlog (0: all of them)"
                           + default("speculative_catch_up_window"))
    spec.add_argument("--no-ngram-cache", action="store_true", default=None,
                      help="ngram: match only the request's own tokens, not earlier requests'")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = set(EngineConfig.__slots__) - {"model", "enable_prefix_caching", "ngram_cache", "draft_options"}
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if args.model is not None:
        kwargs["model"] = args.model
    draft_options = {o.name: value for o in all_options() if o.name != "num_assistant_tokens"
                     and (value := getattr(args, o.name, None)) is not None}
    return EngineConfig(enable_prefix_caching=not args.no_prefix_caching, ngram_cache=not args.no_ngram_cache,
                        draft_options=draft_options, **kwargs)
