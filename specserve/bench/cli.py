"""Command-line flags of `specserve bench serve`, `specserve bench sweep` and `specserve tune`.

Flags mirror `vllm bench serve`'s names and defaults. `add_bench_parsers(subparsers)` plugs them into the main CLI;
`python -m specserve.bench.cli bench serve ...` runs them on their own.
"""
import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from specserve.bench.metrics import LATENCY_HEADERS
from specserve.bench.serve import run_serve
from specserve.bench.sweep import run_sweep
from specserve.bench.tune import run_tune
from specserve.config import MAX_NUM_ASSISTANT_TOKENS, SPEC_METHODS, default_model_dir


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)  # accepts "inf"
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"num_assistant_tokens\": 5}}', got {text}")
    return value


def assistant_token_list(text: str) -> list[int | str]:
    try:
        values = [part.strip() if part.strip() == "auto" else int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers (or auto) like 0,2,4,auto, "
                                         f"got {text}") from None
    if not values or not all(v == "auto" or 0 <= v <= MAX_NUM_ASSISTANT_TOKENS for v in values):
        raise argparse.ArgumentTypeError(f"must be integers in [0, {MAX_NUM_ASSISTANT_TOKENS}] or auto, got {text}")
    return values


def positive_int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1 like 1,2,4,8, got {text}")
    return values


def method_list(text: str) -> list[str]:
    methods = [part.strip() for part in text.split(",") if part.strip()]
    if unknown := [m for m in methods if m not in SPEC_METHODS]:
        raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(unknown)}; "
                                         f"choose from {', '.join(SPEC_METHODS)}")
    return methods


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text}")
    return value


def percentile_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers in (0, 100], got {text}")
    return values


def latency_metric_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if unknown := [name for name in names if name not in LATENCY_HEADERS]:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {','.join(LATENCY_HEADERS)}")
    return names


def add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", help="server base URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", choices=["/v1/completions", "/v1/chat/completions"],
                   help="default: from --backend (/v1/completions for openai)")
    g.add_argument("--backend", choices=["openai", "openai-chat"], help="default: from --endpoint, else openai")
    g.add_argument("--model", help="model name to request (default: the first of /v1/models); a local directory "
                                   "is also the tokenizer")
    g.add_argument("--served-model-name", help="name to put in requests, when it differs from --model")
    g.add_argument("--tokenizer", help="tokenizer directory for sizing prompts (default: --model if a local "
                                       "directory, else the demo model)")


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset-name", choices=["sonnet", "random", "jsonl"], default="sonnet")
    g.add_argument("--dataset-path", help="sonnet text (default: the copy shipped with specserve) or a .jsonl file "
                                          "with 'prompt', 'turns' or 'question' per line")
    g.add_argument("--input-len", type=positive_int, help="overrides the dataset's input length")
    g.add_argument("--output-len", type=positive_int, help="overrides the dataset's output length (jsonl: 256)")
    g.add_argument("--sonnet-input-len", type=positive_int, default=550)
    g.add_argument("--sonnet-output-len", type=positive_int, default=150)
    g.add_argument("--sonnet-prefix-len", type=int, default=200)
    g.add_argument("--random-input-len", type=positive_int, default=1024)
    g.add_argument("--random-output-len", type=positive_int, default=128)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--random-range-ratio", type=fraction, default=0.0)


def add_load_args(p: argparse.ArgumentParser, num_prompts: int, max_concurrency: int | None, num_warmups: int) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=positive_int, default=num_prompts)
    g.add_argument("--max-concurrency", type=positive_int, default=max_concurrency)
    g.add_argument("--request-rate", type=positive_float, default=float("inf"),
                   help="requests/s with Poisson arrivals; inf sends all at once")
    g.add_argument("--burstiness", type=positive_float, default=1.0, help="1 = Poisson; gamma-distributed gaps else")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--extra-body", type=json_object,
                   help='JSON merged into each request, e.g. \'{"num_assistant_tokens": 5}\'')
    g.add_argument("--num-warmups", type=int, default=num_warmups, help="requests sent before each measurement")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--percentile-metrics", type=latency_metric_list, default=("ttft", "tpot", "itl"),
                   help=f"latencies to print, of {','.join(LATENCY_HEADERS)} (default ttft,tpot,itl)")
    g.add_argument("--metric-percentiles", type=percentile_list, default=(99.0,), help="default 99")


def add_sweep_args(p: argparse.ArgumentParser, default_ks: str) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument("--num-assistant-tokens", type=assistant_token_list,
                   default=assistant_token_list(default_ks),
                   help=f"values to try, 0 = plain decoding (default {default_ks})")
    g.add_argument("--result-dir", default="bench_results", help="where the CSV, JSON, PNG and server logs go")
    g.add_argument("--server-args", help="extra flags for each launched `specserve serve`, as one string")
    g.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for /health")
    g.add_argument("--label", help="name of the running server's method in the table (default: server)")
    g.add_argument("--repeats", type=positive_int, default=1,
                   help="measure every setting this many times, in interleaved rounds, and keep the median")
    g.add_argument("--max-repeats", type=positive_int, metavar="N",
                   help="with \"auto\" among the settings: after --repeats rounds at a concurrency, go on with more, "
                        "up to N, while an interval of auto's against the best fixed setting there still reaches "
                        "across the goal (0.97x; at concurrency 1, 1x)")
    g.add_argument("--keep-server-caches", action="store_true",
                   help="launched servers keep prefix caching and the n-gram cache (default: off, since every "
                        "setting sends the same prompts)")


def check_args(args: argparse.Namespace, error: Callable[[str], None]) -> None:
    """Cross-flag checks; `error` is the parser's, so the message names the flag and exits like argparse."""
    chat_endpoint = (args.endpoint or "").endswith("/chat/completions")
    if args.backend and args.endpoint and chat_endpoint != (args.backend == "openai-chat"):
        error(f"--backend {args.backend} does not speak --endpoint {args.endpoint}")
    if args.dataset_name == "jsonl" and not args.dataset_path:
        error("--dataset-path is required with --dataset-name jsonl")
    if args.dataset_path and not Path(args.dataset_path).is_file():
        error(f"--dataset-path {args.dataset_path}: no such file")
    if getattr(args, "max_repeats", None) and args.max_repeats < args.repeats:
        error(f"--max-repeats {args.max_repeats} is under --repeats {args.repeats}")
    if args.tokenizer and not Path(args.tokenizer).is_dir():
        error(f"--tokenizer {args.tokenizer}: not a directory")


def checked(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], object],
            needs_model_dir: Callable[[argparse.Namespace], bool] = lambda args: False) -> Callable[..., int]:
    """`run` behind the cross-flag checks, which report through `parser` like any argparse error; returns the
    exit status (the results are `run`'s return value, for callers in Python)."""
    def run_checked(args: argparse.Namespace) -> int:
        check_args(args, parser.error)
        if needs_model_dir(args):
            if args.model is None:                               # as `specserve serve` with no model
                try:
                    args.model = str(default_model_dir())
                except (FileNotFoundError, ValueError) as e:
                    parser.error(f"--model: none given, and {e}")
            if not Path(args.model).is_dir():
                parser.error(f"--model must be a local model directory here, got {args.model}")
        try:
            run(args)
        except ConnectionError as e:
            parser.exit(1, f"{parser.prog}: error: {e}\n")
        return 0
    return run_checked


def add_bench_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Adds `bench serve`, `bench sweep` and `tune`; each sets func= to a runner taking the parsed args."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server").add_subparsers(
        dest="bench_command", required=True)

    serve = bench.add_parser("serve", help="load-test a server; prints vLLM's Serving Benchmark Result")
    add_target_args(serve)
    add_dataset_args(serve)
    add_load_args(serve, num_prompts=1000, max_concurrency=None, num_warmups=0)
    serve.add_argument("--save-result", metavar="FILE", help="write the result as JSON")
    serve.set_defaults(func=checked(serve, run_serve))

    sweep = bench.add_parser("sweep", help="throughput and acceptance over num_assistant_tokens and methods")
    add_target_args(sweep)
    add_dataset_args(sweep)
    add_load_args(sweep, num_prompts=20, max_concurrency=1, num_warmups=1)
    add_sweep_args(sweep, default_ks="0,1,2,3,4,6,8")
    sweep.add_argument("--concurrency", type=positive_int_list, metavar="C1,C2,...",
                       help="sweep these max concurrencies too (throughput against concurrency, one line per setting)")
    sweep.add_argument("--prompts-per-concurrency", type=positive_int, metavar="N",
                       help="at concurrency c, run max(--num-prompts, N * c) prompts")
    sweep.add_argument("--methods", type=method_list,
                       help=f"launch `specserve serve --model DIR` once per method ({','.join(SPEC_METHODS)}; DIR "
                            "defaults to the default model); without it, sweep the server at --base-url")
    sweep.set_defaults(func=checked(sweep, run_sweep, needs_model_dir=lambda args: bool(args.methods)))

    tune = subparsers.add_parser("tune", help="measure the best num_assistant_tokens and write it to "
                                              "<model>/generation_config.json")
    add_target_args(tune)
    add_dataset_args(tune)
    add_load_args(tune, num_prompts=20, max_concurrency=1, num_warmups=1)
    add_sweep_args(tune, default_ks="0,1,2,3,4,5,6,8")
    tune.add_argument("--method", choices=SPEC_METHODS[1:],
                      help="launch the model with this method (default: measure the server at --base-url)")
    tune.add_argument("--tolerance", type=fraction, default=0.05,
                      help="pick the smallest value within this fraction of the best tokens/s (default 0.05)")
    tune.set_defaults(func=checked(tune, run_tune, needs_model_dir=lambda args: True))


def build_parser() -> argparse.ArgumentParser:
    """Just the bench and tune commands (specserve.cli adds them to the full CLI)."""
    parser = argparse.ArgumentParser(prog="specserve")
    add_bench_parsers(parser.add_subparsers(dest="command", required=True))
    return parser


if __name__ == "__main__":
    cli_args = build_parser().parse_args()
    sys.exit(cli_args.func(cli_args))
