"""The figures of `vllm bench serve`, computed and printed the way it computes and prints them."""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specserve.bench.client import RequestFuncOutput, SpecCounters

LATENCY_HEADERS = {  # name in results -> (label in rows, section header)
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(slots=True)
class Distribution:
    """Milliseconds. Empty input gives zeros, as in vLLM (`np.mean(values or 0)`)."""
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, seconds: list[float], percentiles: tuple[float, ...]) -> "Distribution":
        values = seconds or 0
        return cls(float(np.mean(values)) * 1000, float(np.median(values)) * 1000, float(np.std(values)) * 1000,
                   {p: float(np.percentile(values, p)) * 1000 for p in percentiles})


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int]
    mean_draft_length: float | None = None     # specserve's usage.draft_lengths: chosen per decode step
    drafting_fraction: float | None = None     # the fraction of decode steps that drafted


def chosen_draft_lengths(outputs: list[RequestFuncOutput]) -> tuple[float | None, float | None]:
    """Mean draft length chosen per decode step, and the fraction of steps drafting, over every request whose
    usage reports them (specserve's draft_lengths; None from other servers)."""
    lengths = [k for out in outputs if out.success for k in out.usage.get("draft_lengths") or []]
    if not lengths:
        return None, None
    return sum(lengths) / len(lengths), sum(k > 0 for k in lengths) / len(lengths)


def output_len(out: RequestFuncOutput, count_tokens: Callable[[str], int] | None) -> int:
    """The usage chunk's count; without one, vLLM re-tokenizes the text (or counts 1 with no tokenizer)."""
    if out.output_tokens:
        return out.output_tokens
    return count_tokens(out.generated_text) if count_tokens is not None else 1


def calculate_metrics(outputs: list[RequestFuncOutput], duration: float, percentiles: tuple[float, ...] = (99.0,),
                      count_tokens: Callable[[str], int] | None = None) -> BenchmarkMetrics:
    ok = [out for out in outputs if out.success]
    output_lens = [output_len(out, count_tokens) if out.success else 0 for out in outputs]
    ok_lens = [n for out, n in zip(outputs, output_lens) if out.success]
    # TPOT is per request, over the tokens after the first; requests of one token have none.
    tpots = [(out.latency - out.ttft) / (n - 1) for out, n in zip(ok, ok_lens) if n > 1]
    itls = [gap for out in ok for gap in out.itl]
    total_input, total_output = sum(out.prompt_len for out in ok), sum(output_lens)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input, total_output=total_output,
        duration=duration, request_throughput=len(ok) / duration, output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        ttft=Distribution.of([out.ttft for out in ok], percentiles), tpot=Distribution.of(tpots, percentiles),
        itl=Distribution.of(itls, percentiles), e2el=Distribution.of([out.latency for out in ok], percentiles),
        max_output_tokens_per_s=peak_output_per_second(ok), max_concurrent_requests=peak_concurrency(ok),
        output_lens=output_lens, **dict(zip(("mean_draft_length", "drafting_fraction"), chosen_draft_lengths(ok))))


def peak_output_per_second(outputs: list[RequestFuncOutput]) -> float:
    """Content chunks per 1-second bucket from the earliest start, at its busiest (vLLM counts chunks)."""
    if not outputs:
        return 0.0
    t0 = min(out.start_time for out in outputs)
    num_buckets = int(np.ceil(max(out.start_time + out.latency for out in outputs) - t0)) + 1
    counts = np.zeros(num_buckets)
    for out in outputs:
        chunk_times = out.start_time + out.ttft + np.concatenate([[0.0], np.cumsum(out.itl)])
        np.add.at(counts, (chunk_times - t0).astype(int).clip(0, num_buckets - 1), 1)
    return float(counts.max())


def peak_concurrency(outputs: list[RequestFuncOutput]) -> int:
    """Most requests in flight at once, over half-open [start, end): an end and a start at one instant don't overlap."""
    events = sorted([(out.start_time, 1) for out in outputs] + [(out.start_time + out.latency, -1) for out in outputs])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float              # percent of drafted tokens accepted
    acceptance_length: float            # tokens per draft step: 1 + accepted / drafts
    per_position_acceptance_rates: list[float]


def spec_decode_stats(before: SpecCounters | None, after: SpecCounters | None) -> SpecDecodeStats | None:
    """What the run added to the server's counters; None if the server drafted nothing."""
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if draft_tokens <= 0:
        return None
    positions = sorted(before.accepted_per_pos.keys() | after.accepted_per_pos.keys())
    per_pos = [(after.accepted_per_pos.get(p, 0) - before.accepted_per_pos.get(p, 0)) / drafts
               for p in positions] if drafts > 0 else []
    return SpecDecodeStats(drafts, draft_tokens, accepted, accepted / draft_tokens * 100,
                           1 + accepted / drafts if drafts > 0 else 0.0, per_pos)


def row(label: str, value: float | int, decimals: bool = True) -> str:
    return f"{label:<40} {value:<10.2f}" if decimals else f"{label:<40} {value:<10}"


def format_result(m: BenchmarkMetrics, spec: SpecDecodeStats | None, max_concurrency: int | None = None,
                  request_rate: float = float("inf"),
                  percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")) -> str:
    lines = [f"{' Serving Benchmark Result ':=^50}",
             row("Successful requests:", m.completed, False), row("Failed requests:", m.failed, False)]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency, False))
    if request_rate != float("inf"):
        lines.append(row("Request rate configured (RPS):", request_rate))
    lines += [row("Benchmark duration (s):", m.duration),
              row("Total input tokens:", m.total_input, False),
              row("Total generated tokens:", m.total_output, False),
              row("Request throughput (req/s):", m.request_throughput),
              row("Output token throughput (tok/s):", m.output_throughput),
              row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
              row("Peak concurrent requests:", m.max_concurrent_requests),
              row("Total token throughput (tok/s):", m.total_token_throughput)]
    if m.mean_draft_length is not None:
        lines += [row("Mean chosen draft length:", m.mean_draft_length),
                  row("Decode steps drafting (%):", m.drafting_fraction * 100)]
    for name in percentile_metrics:
        label, header = LATENCY_HEADERS[name]
        dist: Distribution = getattr(m, name)
        lines += [f"{header:-^50}", row(f"Mean {label} (ms):", dist.mean), row(f"Median {label} (ms):", dist.median)]
        lines += [row(f"P{percentile_word(p)} {label} (ms):", v) for p, v in dist.percentiles.items()]
    if spec is not None:
        lines += [f"{'Speculative Decoding':-^50}",
                  row("Acceptance rate (%):", spec.acceptance_rate),
                  row("Acceptance length:", spec.acceptance_length),
                  row("Drafts:", spec.num_drafts, False),
                  row("Draft tokens:", spec.draft_tokens, False),
                  row("Accepted tokens:", spec.accepted_tokens, False)]
        if spec.per_position_acceptance_rates:
            lines.append("Per-position acceptance (%):")
            lines += [row(f"  Position {i}:", rate * 100) for i, rate in enumerate(spec.per_position_acceptance_rates)]
    lines.append("=" * 50)
    return "\n".join(lines)


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def result_dict(m: BenchmarkMetrics, spec: SpecDecodeStats | None, outputs: list[RequestFuncOutput]) -> dict:
    """The JSON `--save-result` writes, with vLLM's key names."""
    result = {
        "duration": m.duration, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s, "max_concurrent_requests": m.max_concurrent_requests,
        "mean_draft_length": m.mean_draft_length, "drafting_fraction": m.drafting_fraction,
        "input_lens": [out.prompt_len for out in outputs], "output_lens": m.output_lens,
        "ttfts": [out.ttft for out in outputs], "itls": [out.itl for out in outputs],
        "latencies": [out.latency for out in outputs], "start_times": [out.start_time for out in outputs],
        "generated_texts": [out.generated_text for out in outputs], "errors": [out.error for out in outputs],
    }
    for name in LATENCY_HEADERS:
        dist: Distribution = getattr(m, name)
        result |= {f"mean_{name}_ms": dist.mean, f"median_{name}_ms": dist.median, f"std_{name}_ms": dist.std}
        result |= {f"p{percentile_word(p)}_{name}_ms": v for p, v in dist.percentiles.items()}
    if spec is not None:
        result |= {"spec_decode_acceptance_rate": spec.acceptance_rate,
                   "spec_decode_acceptance_length": spec.acceptance_length,
                   "spec_decode_num_drafts": spec.num_drafts, "spec_decode_draft_tokens": spec.draft_tokens,
                   "spec_decode_accepted_tokens": spec.accepted_tokens,
                   "spec_decode_per_position_acceptance_rates": spec.per_position_acceptance_rates}
    return result
