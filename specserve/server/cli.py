"""`specserve serve [MODEL_DIR] [flags]`: the OpenAI-compatible server's command line.

Every flag defaults to None here so that precedence is exact: a flag on the command line, then the same
key in --config FILE (JSON), then SERVE_DEFAULTS / EngineConfig's defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from specserve.config import MAX_NUM_ASSISTANT_TOKENS, SPEC_METHODS, EngineConfig

SERVE_DEFAULTS = {"host": "127.0.0.1", "port": 8000, "max_queue_len": 256, "log_level": "info",
                  "no_prefix_caching": False, "no_ngram_cache": False}
ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}
CONFIG_ALIASES = {"draft_models_path": "draft_model", "model_path": "model", "max_ngram_size": "prompt_lookup_max"}
CONFIG_NEGATIONS = {"enable_prefix_caching": "no_prefix_caching", "ngram_cache": "no_ngram_cache"}
PATH_KEYS = ("model", "draft_model")


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


def default(name: str) -> str:
    value = SERVE_DEFAULTS.get(name, ENGINE_DEFAULTS.get(name))
    return f" (default: {value})" if value is not None else ""


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                   help="Hugging Face-style model folder (default: the demo model shipped with specserve)")
    p.add_argument("--config", metavar="FILE", help="JSON file whose keys (flag names with underscores, or "
                   "draft_models_path) fill the flags not given on the command line; paths are relative to it")
    server = p.add_argument_group("server")
    server.add_argument("--host", help="address to listen on" + default("host"))
    server.add_argument("--port", type=int_at_least(0, 65535), help="port" + default("port"))
    server.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="model name(s) clients send; the first is reported (default: MODEL_DIR as given)")
    server.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1, /tokenize, /detokenize")
    server.add_argument("--max-queue-len", type=int_at_least(0),
                        help="requests that may wait beyond --max-num-seqs; more get HTTP 503" + default("max_queue_len"))
    # a concrete default: it replaces the top-level `specserve --log-level` (a server logs its start-up at info)
    server.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                        default=SERVE_DEFAULTS["log_level"], type=str.lower, help="logging level" + default("log_level"))
    engine = p.add_argument_group("engine")
    engine.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations dtype; auto: the checkpoint's on CUDA, float32 on CPU")
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
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=SPEC_METHODS,
                      help="default: detected (a drafter in a subfolder of MODEL_DIR, else none)")
    spec.add_argument("--draft-model", metavar="PATH", help="drafter folder; its kind is read from its config.json")
    spec.add_argument("--num-assistant-tokens", type=int_at_least(0, MAX_NUM_ASSISTANT_TOKENS),
                      help="draft tokens per step, for requests that do not set it (default: generation_config.json, else 5)")
    spec.add_argument("--prompt-lookup-min", type=int_at_least(1), help="smallest n-gram matched (ngram)")
    spec.add_argument("--prompt-lookup-max", "--max-ngram-size", type=int_at_least(1), help="largest n-gram matched (ngram)")
    spec.add_argument("--branching-factor", type=int_at_least(1), help="children per tree node (tree drafting)")
    spec.add_argument("--tree-depth", type=int_at_least(0), help="draft tree depth; 0 drafts a chain")
    spec.add_argument("--no-ngram-cache", action="store_true", default=None,
                      help="ngram: match only the request's own tokens, not earlier requests'")


def config_file_argv(path: str, parser: argparse.ArgumentParser, flags: set[str]) -> list[str]:
    """The --config file as command-line arguments, so the parser checks it like the command line.
    flags: the parser's destination names."""
    file = Path(path)
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        parser.error(f"cannot read --config {path}: {e}")
    if not isinstance(config, dict):
        parser.error(f"--config {path} must hold a JSON object")
    argv: list[str] = []
    for key, value in config.items():
        name = CONFIG_ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name in CONFIG_NEGATIONS and isinstance(value, bool):
            name, value = CONFIG_NEGATIONS[name], not value
        if name not in flags or name in ("config", "func", "log_level"):
            parser.error(f"unknown key {key!r} in --config {path}")
        if name in PATH_KEYS and isinstance(value, str) and not Path(value).is_absolute():
            value = str(file.parent / value)
        flag = "--" + name.replace("_", "-")
        if name == "model":
            argv.insert(0, str(value))
        elif isinstance(SERVE_DEFAULTS.get(name), bool):
            if not isinstance(value, bool):
                parser.error(f"{key!r} in --config {path} must be true or false, got {value!r}")
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def resolve_serve_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill unset flags from --config, then from the defaults."""
    flags = set(vars(parser.parse_args([])))
    from_file = parser.parse_args(config_file_argv(args.config, parser, flags)) if args.config else None
    for name in flags:
        value = getattr(args, name, None)
        if value is None and from_file is not None:
            value = getattr(from_file, name)
        if value is None:
            value = SERVE_DEFAULTS.get(name, ENGINE_DEFAULTS.get(name))
        setattr(args, name, value)
    return args


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = set(EngineConfig.__slots__) - {"model", "enable_prefix_caching", "ngram_cache"}
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if args.model is not None:
        kwargs["model"] = args.model
    return EngineConfig(enable_prefix_caching=not args.no_prefix_caching, ngram_cache=not args.no_ngram_cache, **kwargs)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server",
                              description="Serve a model over an OpenAI-compatible HTTP API with speculative decoding.")
    add_serve_arguments(p)

    def serve(args: argparse.Namespace) -> None:
        from specserve.server.api_server import run_server
        run_server(resolve_serve_args(args, p))

    p.set_defaults(func=serve)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specserve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
