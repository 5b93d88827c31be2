"""`specserve bench sweep`: the same prompts at each num_assistant_tokens ("auto" included) and each concurrency,
for each method and plain decoding."""
import argparse
import asyncio
import csv
import json
import shlex
import statistics
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from specserve.bench.auto_table import auto_against_fixed, baseline_of, comparisons, undecided
from specserve.bench.launch import ServerStartError, launched_server
from specserve.bench.plots import plot
from specserve.bench.serve import BenchResult, base_url_of, benchmark, prepare, print_failures

PLAIN = "none"  # the --speculative-method of plain decoding


@dataclass(slots=True)
class SweepPoint:
    method: str
    num_assistant_tokens: int | str     # 0 = drafting off; "auto": chosen per step by the server
    acceptance_length: float | None     # 1 + accepted / drafts; None when nothing was drafted
    tokens_per_step: float              # output tokens per target forward pass
    output_throughput: float            # output tokens/s
    mean_tpot_ms: float
    completed: int
    failed: int
    concurrency: int | None = None      # --max-concurrency of the run
    mean_draft_length: float | None = None   # chosen per decode step (the server's usage.draft_lengths)
    speedup: float | None = None        # output tokens/s over plain decoding's, at the same concurrency
    block: str | None = None            # the method whose interleaved block measured it (plain's own baseline)
    runs: list[float] | None = None     # each round's output tokens/s (--repeats); output_throughput: their median
    mean_ttft_ms: float | None = None   # time to first token: the prompt's wait and prefill, which TPOT leaves out


def usage_total(result: BenchResult, key: str) -> int:
    """A usage field summed over successful requests (specserve's usage carries speculative statistics)."""
    return sum(out.usage.get(key) or 0 for out in result.outputs if out.success)


def tokens_per_target_step(result: BenchResult) -> float:
    """From the usage's num_target_forwards when the server reports it. Otherwise from the counters: each
    target pass verifies at most one draft and yields one token plus the draft tokens it accepts, so
    target passes = output tokens - accepted tokens."""
    total = result.metrics.total_output
    if forwards := usage_total(result, "num_target_forwards"):
        return total / forwards
    accepted = result.spec.accepted_tokens if result.spec else 0
    return total / (total - accepted) if total > accepted else 0.0


def acceptance_length(result: BenchResult) -> float | None:
    """1 + accepted / drafts: from the server's counters, else from the usage, else None (no drafting seen)."""
    if result.spec is not None:
        return result.spec.acceptance_length
    if drafts := usage_total(result, "num_drafts"):
        return 1 + usage_total(result, "num_accepted_tokens") / drafts
    return None


def point_of(method: str, num_assistant_tokens: int | str, result: BenchResult, concurrency: int | None = None
             ) -> SweepPoint:
    m = result.metrics
    return SweepPoint(method, num_assistant_tokens, acceptance_length(result), tokens_per_target_step(result),
                      m.output_throughput, m.tpot.mean, m.completed, m.failed, concurrency, m.mean_draft_length,
                      mean_ttft_ms=m.ttft.mean)


def concurrencies_of(args: argparse.Namespace) -> list[int | None]:
    return getattr(args, "concurrency", None) or [args.max_concurrency]


def num_prompts_at(args: argparse.Namespace, concurrency: int | None) -> int:
    """--num-prompts, or more at high concurrency: --prompts-per-concurrency per request slot."""
    per_slot = getattr(args, "prompts_per_concurrency", None)
    return max(args.num_prompts, per_slot * concurrency) if per_slot and concurrency else args.num_prompts


@dataclass(slots=True)
class Target:
    """One server in a sweep block: the method it runs, its URL and the num_assistant_tokens measured on it."""
    method: str
    base_url: str
    ks: list[int | str]


async def measure_block(args: argparse.Namespace, targets: list[Target], block: str) -> list[SweepPoint]:
    """Every (server, k) setting of `targets` at each concurrency, --repeats times in interleaved rounds, so that a
    change in the machine's load falls on every setting alike: rounds go in mirrored pairs, each pair starting one
    setting later (A B C, C B A, then B C A, A C B, ...), and a pair cancels a steady drift exactly (A B B A).
    Each point keeps the median of its rounds' throughputs; its other figures come from the round nearest it. After
    --repeats rounds at a concurrency, rounds go on while the goal for "auto" is undecided there (auto_table.undecided),
    up to --max-repeats: where a cell's interval is already clear of the goal, no more time goes to it."""
    concurrencies, repeats = concurrencies_of(args), getattr(args, "repeats", 1) or 1
    most_rounds = max(repeats, getattr(args, "max_repeats", None) or 0)
    most = argparse.Namespace(**{**vars(args), "num_prompts": max(num_prompts_at(args, c) for c in concurrencies)})
    prepared = [await prepare(most, t.base_url) for t in targets]
    settings = [(t, cfg, samples, tokenizer, k) for t, (cfg, samples, tokenizer) in zip(targets, prepared)
                for k in t.ks]
    points, order = [], list(range(len(settings)))
    for c in concurrencies:
        rounds: dict[int, list[SweepPoint]] = {i: [] for i in order}
        r = 0
        while r < repeats or r < most_rounds and any(
                undecided(x) for x in comparisons([median_point(rounds[i], block) for i in order])):
            label = (f" round {r + 1} of at most {most_rounds} (goal undecided)" if r >= repeats
                     else f" round {r + 1}/{repeats}" if most_rounds > 1 else "")
            for i in round_order(order, r):
                target, cfg, samples, tokenizer, k = settings[i]
                body = {**(cfg.extra_body or {}), "num_assistant_tokens": k}
                run_cfg = replace(cfg, max_concurrency=c, extra_body=body)
                result = await benchmark(run_cfg, samples[:num_prompts_at(args, c)],
                                         lambda text, tok=tokenizer: len(tok.encode(text, add_special_tokens=False)))
                print_failures(result.outputs)
                rounds[i].append(point := point_of(target.method, k, result, c))
                print(f"{target.method} num_assistant_tokens={k} concurrency={c}{label}: "
                      f"{point.output_throughput:.2f} tok/s, "
                      f"{point.tokens_per_step:.2f} tokens/step, TTFT {point.mean_ttft_ms:.1f} ms, "
                      f"TPOT {point.mean_tpot_ms:.2f} ms", flush=True)
            r += 1
        points += [median_point(rounds[i], block) for i in order]
    return points


def round_order(order: list[int], r: int) -> list[int]:
    """Round r's order: pair r // 2 rotates `order` by one more, and its second round runs it backwards."""
    shift = (r // 2) % len(order)
    rotated = order[shift:] + order[:shift]
    return rotated if r % 2 == 0 else rotated[::-1]


def median_point(runs: list[SweepPoint], block: str) -> SweepPoint:
    middle = statistics.median(p.output_throughput for p in runs)
    nearest = min(runs, key=lambda p: abs(p.output_throughput - middle))
    return replace(nearest, output_throughput=middle, block=block, runs=[p.output_throughput for p in runs])


def ks_for_method(method: str, ks: list[int | str], methods: list[str]) -> list[int | str]:
    """The plain server measures k=0 only; without one, the first method's server measures k=0 as the baseline."""
    if method == PLAIN:
        return [0]
    drafting = [k for k in ks if k != 0]
    return [0, *drafting] if PLAIN not in methods and method == methods[0] else drafting


def sweep_points(args: argparse.Namespace, methods: list[str] | None, ks: list[int],
                 skip_unavailable: bool = True) -> list[SweepPoint]:
    """With methods: one launched server per method (--model is then the model directory); a method the model
    cannot run is skipped when `skip_unavailable`. With plain decoding ("none") among several methods, its
    server stays up for the whole sweep and is measured inside each method's block, interleaved with it.
    Launched servers run without prefix caching and the n-gram cache unless --keep-server-caches.
    Without methods: the server at --base-url / --host:--port, every k."""
    if not methods:
        label = args.label or "server"
        return asyncio.run(measure_block(args, [Target(label, base_url_of(args), ks)], label))
    result_dir = Path(args.result_dir)
    extra = shlex.split(args.server_args or "")
    if not getattr(args, "keep_server_caches", False):
        # every setting and round sends the same prompts: a server's prefix cache (its prefills) and n-gram cache
        # (its earlier answers) would make whichever setting runs later faster
        extra += ["--no-prefix-caching", "--no-ngram-cache"]
    drafting = [m for m in methods if m != PLAIN]
    with ExitStack() as stack:
        plain = None
        if PLAIN in methods:
            plain = Target(PLAIN, stack.enter_context(launched_server(
                args.model, PLAIN, result_dir / f"server-{PLAIN}.log", extra, args.server_timeout)), [0])
            if not drafting:
                return asyncio.run(measure_block(args, [plain], PLAIN))
        points = []
        for method in drafting:
            try:
                with launched_server(args.model, method, result_dir / f"server-{method}.log", extra,
                                     args.server_timeout) as base_url:
                    targets = [Target(method, base_url, ks_for_method(method, ks, methods))]
                    points += asyncio.run(measure_block(args, [plain, *targets] if plain else targets, method))
            except ServerStartError as e:
                if not skip_unavailable:
                    raise
                print(f"Skipping --speculative-method {method}: {e}")
        return points


def add_speedups(points: list[SweepPoint]) -> None:
    for p in points:
        baseline = baseline_of(p, points)
        if baseline is not None and baseline.output_throughput > 0:
            p.speedup = p.output_throughput / baseline.output_throughput


def format_table(points: list[SweepPoint]) -> str:
    header = (f"{'method':<10} {'k':>4} {'conc':>4} {'accept len':>10} {'tok/step':>9} {'out tok/s':>10} "
              f"{'TTFT ms':>9} {'TPOT ms':>9} {'speedup':>8}")
    lines = [header, "-" * len(header)]
    for p in points:
        accept = f"{p.acceptance_length:.2f}" if p.acceptance_length is not None else "-"
        speedup = f"{p.speedup:.2f}x" if p.speedup is not None else "-"
        ttft = f"{p.mean_ttft_ms:.1f}" if p.mean_ttft_ms is not None else "-"
        lines.append(f"{p.method:<10} {p.num_assistant_tokens!s:>4} {p.concurrency or '-'!s:>4} {accept:>10} "
                     f"{p.tokens_per_step:>9.2f} {p.output_throughput:>10.2f} {ttft:>9} {p.mean_tpot_ms:>9.2f} "
                     f"{speedup:>8}")
    return "\n".join(lines)


def write_results(points: list[SweepPoint], result_dir: Path, name: str = "sweep") -> list[Path]:
    result_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path, png_path = (result_dir / f"{name}.{ext}" for ext in ("csv", "json", "png"))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(SweepPoint)])
        writer.writeheader()
        writer.writerows(asdict(p) for p in points)
    json_path.write_text(json.dumps([asdict(p) for p in points], indent=2))
    plot(points, png_path)
    return [csv_path, json_path, png_path]


def run_sweep(args: argparse.Namespace) -> list[SweepPoint]:
    points = sweep_points(args, args.methods, args.num_assistant_tokens)
    add_speedups(points)
    print(format_table(points))
    if any(p.num_assistant_tokens == "auto" for p in points):
        print(auto_against_fixed(points))
    for path in write_results(points, Path(args.result_dir)):
        print(f"Wrote {path}")
    return points
