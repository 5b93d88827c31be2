"""specserve.bench: figures from synthetic timings, prompt builders, SSE parsing, and the CLI against a fake server."""
import asyncio
import json
import math
import re
import socket
import statistics
import threading
import time
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from specserve.bench.client import (RequestInput, RequestFuncOutput, SSEDecoder, SpecCounters, build_payload,
                                    parse_spec_counters)
from specserve.bench.datasets import (SONNET_BASE_PROMPT, default_sonnet_path, load_jsonl_prompts, load_sonnet,
                                      sample_jsonl, sample_random, sample_sonnet)
from specserve.bench.metrics import (calculate_metrics, format_result, peak_concurrency, result_dict,
                                     spec_decode_stats)
from specserve.bench.cli import build_parser
from specserve.bench.serve import BenchResult, arrival_times, run_serve
from specserve.bench.auto_table import (Comparison, auto_against_fixed, paired_interval, round_noise, t_quantile,
                                        undecided)
from specserve.bench.sweep import (SweepPoint, Target, acceptance_length, add_speedups, format_table, measure_block,
                                   run_sweep, tokens_per_target_step, write_results)
from specserve.bench.plots import concurrency_lines, plot_concurrency
from specserve.bench.tune import pick_num_assistant_tokens, write_generation_config

SONNET = default_sonnet_path()


class WordTokenizer:
    """One token per whitespace-separated word; "w<id>" words decode/encode to themselves; id 0 is BOS."""
    vocab_size = 500
    all_special_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [int(w[1:]) if re.fullmatch(r"w\d+", w) else 1 + zlib.crc32(w.encode()) % 499 for w in text.split()]
        return [0] * add_special_tokens + ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids if i != 0)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return f"<user> {messages[0]['content']} <assistant>"


def finished(start: float, ttft: float, itl: list[float], output_tokens: int, prompt_len: int) -> RequestFuncOutput:
    return RequestFuncOutput(success=True, prompt_len=prompt_len, output_tokens=output_tokens, start_time=start,
                         ttft=ttft, itl=itl, latency=ttft + sum(itl))


# --- figures ---


def test_metrics_from_synthetic_timings():
    outputs = [
        finished(0.0, 0.1, [0.05, 0.05, 0.1], output_tokens=4, prompt_len=10),   # chunks at .1 .15 .2 .3
        finished(0.2, 0.2, [0.5, 0.5], output_tokens=5, prompt_len=20),          # chunks at .4 .9 1.4
        RequestFuncOutput(success=False, error="HTTP 500", prompt_len=99),
    ]
    m = calculate_metrics(outputs, duration=2.0)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 30, 9)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(19.5)
    assert m.ttft.mean == pytest.approx(150.0) and m.ttft.median == pytest.approx(150.0)
    # TPOT per request: (0.3 - 0.1) / 3 and (1.2 - 0.2) / 4
    assert m.tpot.mean == pytest.approx((200 / 3 + 250) / 2)
    # ITL pooled over requests: 50, 50, 100, 500, 500 ms
    assert m.itl.mean == pytest.approx(240.0) and m.itl.median == pytest.approx(100.0)
    assert m.itl.percentiles[99.0] == pytest.approx(500.0)
    assert m.e2el.mean == pytest.approx(750.0)
    assert m.max_output_tokens_per_s == 6.0   # 4 + 2 chunks in [0, 1)
    assert m.max_concurrent_requests == 2
    assert m.output_lens == [4, 5, 0]


def test_metrics_edge_cases():
    touching = [finished(0.0, 0.5, [0.5], 2, 1), finished(1.0, 0.5, [0.5], 2, 1)]
    assert peak_concurrency(touching) == 1   # an end and a start at the same instant do not overlap
    no_usage = finished(0.0, 0.1, [0.1], output_tokens=0, prompt_len=1)
    no_usage.generated_text = "a b c"
    assert calculate_metrics([no_usage], 1.0, count_tokens=lambda t: len(t.split())).total_output == 3
    one_token = calculate_metrics([finished(0.0, 0.1, [], 1, 1)], 1.0)
    assert one_token.tpot.mean == 0.0 and one_token.itl.mean == 0.0   # no TPOT for single-token requests
    nothing = calculate_metrics([RequestFuncOutput(error="x")], 1.0)
    assert nothing.completed == 0 and nothing.ttft.mean == 0.0 and nothing.max_output_tokens_per_s == 0.0


METRICS_TEXT = """# HELP vllm:spec_decode_num_drafts_total Number of drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:num_requests_running{engine="0"} 1.0
"""


def test_spec_counters_and_their_change():
    before = SpecCounters(4, 12, 5, {0: 3, 1: 2})
    after = parse_spec_counters(METRICS_TEXT)
    assert after == SpecCounters(10, 30, 15, {0: 8, 1: 5, 2: 2})
    assert parse_spec_counters("vllm:num_requests_running 1.0\n") is None
    stats = spec_decode_stats(before, after)
    assert (stats.num_drafts, stats.draft_tokens, stats.accepted_tokens) == (6, 18, 10)
    assert stats.acceptance_rate == pytest.approx(100 * 10 / 18)
    assert stats.acceptance_length == pytest.approx(1 + 10 / 6)
    assert stats.per_position_acceptance_rates == pytest.approx([5 / 6, 3 / 6, 2 / 6])
    assert spec_decode_stats(after, after) is None and spec_decode_stats(None, after) is None


def test_printed_block_has_vllm_rows_in_order():
    m = calculate_metrics([finished(0.0, 0.1, [0.05, 0.05], 3, 10)], duration=1.0)
    spec = spec_decode_stats(SpecCounters(), parse_spec_counters(METRICS_TEXT))
    text = format_result(m, spec, max_concurrency=1, request_rate=4.0)
    labels = [line if line[0] in "=-" else line[:40].strip() for line in text.splitlines()]
    assert labels[0] == "============ Serving Benchmark Result ============"
    expected = ["Successful requests:", "Failed requests:", "Maximum request concurrency:",
                "Request rate configured (RPS):", "Benchmark duration (s):", "Total input tokens:",
                "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                "Peak output token throughput (tok/s):", "Peak concurrent requests:",
                "Total token throughput (tok/s):", "---------------Time to First Token----------------",
                "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):", "Median TPOT (ms):",
                "P99 TPOT (ms):", "---------------Inter-token Latency----------------", "Mean ITL (ms):",
                "Median ITL (ms):", "P99 ITL (ms):", "---------------Speculative Decoding---------------",
                "Acceptance rate (%):", "Acceptance length:", "Drafts:", "Draft tokens:", "Accepted tokens:",
                "Per-position acceptance (%):", "Position 0:", "Position 1:", "Position 2:", "=" * 50]
    assert labels[1:] == expected
    assert "Successful requests:                     1         " in text
    assert "Acceptance length:                       2.50      " in text
    assert "Request rate configured" not in format_result(m, None)
    assert json.dumps(result_dict(m, spec, []))   # serialisable


def test_chosen_draft_lengths_from_usage():
    outs = [finished(0.0, 0.1, [0.05], 2, 5), finished(0.0, 0.1, [0.05], 2, 5)]
    outs[0].usage, outs[1].usage = {"draft_lengths": [4, 0]}, {"draft_lengths": [2, 2]}
    m = calculate_metrics(outs, duration=1.0)
    assert (m.mean_draft_length, m.drafting_fraction) == (2.0, 0.75)
    assert "Mean chosen draft length:                2.00" in format_result(m, None)
    assert calculate_metrics(outs[:0] + [finished(0.0, 0.1, [0.05], 2, 5)], duration=1.0).mean_draft_length is None


def test_arrival_times():
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    times = arrival_times(50, request_rate=10.0, seed=1)
    assert times == arrival_times(50, request_rate=10.0, seed=1) != arrival_times(50, request_rate=10.0, seed=2)
    assert all(a < b for a, b in zip(times, times[1:]))
    assert times[-1] == pytest.approx(5.0)   # rescaled to num_requests / rate, as vLLM does
    assert arrival_times(4, 2.0, burstiness=float("inf")) == pytest.approx([0.5, 1.0, 1.5, 2.0])


# --- prompts ---


def test_sonnet_deterministic_and_within_input_length():
    lines, tok = load_sonnet(SONNET), WordTokenizer()
    a = sample_sonnet(lines, tok, 5, input_len=120, output_len=30, prefix_len=50, seed=7)
    assert a == sample_sonnet(lines, tok, 5, input_len=120, output_len=30, prefix_len=50, seed=7)
    assert a != sample_sonnet(lines, tok, 5, input_len=120, output_len=30, prefix_len=50, seed=8)
    prefix = SONNET_BASE_PROMPT + lines[0]
    for s in a:
        assert s.prompt.startswith(prefix)           # raw prompt: instruction + shared prefix lines
        assert s.prompt_len == len(tok.encode(tok.apply_chat_template([{"role": "user", "content": s.prompt}])))
        assert 80 <= s.prompt_len <= 120 and s.expected_output_len == 30
    formatted = sample_sonnet(lines, tok, 2, input_len=120, prefix_len=50, seed=7, return_prompt_formatted=True)
    assert formatted[0].prompt == tok.apply_chat_template([{"role": "user", "content": a[0].prompt}])
    with pytest.raises(ValueError, match="must exceed"):
        sample_sonnet(lines, tok, 1, input_len=5)


def test_random_prompts_hit_their_lengths():
    tok = WordTokenizer()
    samples = sample_random(tok, 4, input_len=33, output_len=9, prefix_len=5, seed=3)
    assert samples == sample_random(tok, 4, input_len=33, output_len=9, prefix_len=5, seed=3)
    for s in samples:
        assert s.prompt_len == 5 + 32 == len(tok.encode(s.prompt, add_special_tokens=False))   # 1 special (BOS)
        assert s.expected_output_len == 9 and 0 not in tok.encode(s.prompt, add_special_tokens=False)
    assert all(s.prompt.split()[:5] == samples[0].prompt.split()[:5] for s in samples)   # the shared prefix


def test_jsonl_reader(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"turns": ["two", "later"]}\n{"question": "three", "id": 3}\n'
                    '{"turns": [{"role": "user", "content": "four"}]}\n')
    prompts = load_jsonl_prompts(path)
    assert prompts == ["one", "two", "three", "four"]
    samples = sample_jsonl(prompts, WordTokenizer(), 6, output_len=12)
    assert [s.prompt for s in samples] == ["one", "two", "three", "four", "one", "two"]
    assert samples[0].prompt_len == 4 and samples[0].expected_output_len == 12   # BOS <user> one <assistant>
    assert sample_jsonl(prompts, WordTokenizer(), 1, return_prompt_formatted=True)[0].prompt == "<user> one <assistant>"
    path.write_text('{"text": "no known field"}\n')
    with pytest.raises(ValueError, match=":1: no 'prompt'"):
        load_jsonl_prompts(path)


# --- streaming ---


def sse(chunks: list[dict | str]) -> bytes:
    payloads = [c if isinstance(c, str) else json.dumps(c, ensure_ascii=False) for c in chunks]
    return "".join(f"data: {payload}\n\n" for payload in payloads).encode()


CHAT_STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "Héllo"}}]},
    {"choices": [{"index": 0, "delta": {"content": " wor"}}]},
    {"choices": [{"index": 0, "delta": {"content": "ld"}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}},
    "[DONE]",
]


@pytest.mark.parametrize("piece", [1, 3, 64, 10_000])
def test_sse_decoder_reassembles_events_split_anywhere(piece):
    raw = b": keep-alive ping\n\n" + sse(CHAT_STREAM).replace(b"\n\n", b"\r\n\r\n", 2)
    decoder, payloads = SSEDecoder(), []
    for i in range(0, len(raw), piece):   # splits inside JSON and inside the two-byte 'é'
        payloads += decoder.feed(raw[i:i + piece])
    payloads += decoder.flush()
    assert payloads[-1] == "[DONE]" and [json.loads(p) for p in payloads[:-1]] == CHAT_STREAM[:-1]


def test_stream_timings_count_content_chunks_only():
    out = RequestFuncOutput(prompt_len=3, start_time=10.0)
    for payload, now in zip(SSEDecoder().feed(sse(CHAT_STREAM)), [10.1, 10.2, 10.25, 10.4, 10.45, 10.5, 10.5]):
        out.add_event(payload, now)
    out.finish()
    assert out.success and out.generated_text == "Héllo world"
    assert out.ttft == pytest.approx(0.2)                      # the role-only chunk is not the first token
    assert out.itl == pytest.approx([0.05, 0.15]) and out.latency == pytest.approx(0.4)
    assert (out.output_tokens, out.prompt_len) == (6, 7)       # from the usage chunk

    completion = RequestFuncOutput(start_time=0.0)
    for payload in SSEDecoder().feed(sse([{"choices": [{"text": "", "finish_reason": "stop"}]}, "[DONE]"])):
        completion.add_event(payload, 0.3)
    completion.finish()
    assert completion.success and completion.ttft == completion.latency == pytest.approx(0.3)   # EOS first

    failed = RequestFuncOutput()
    failed.add_event(json.dumps({"error": {"message": "boom"}}), 1.0)
    failed.finish()
    assert not failed.success and "boom" in failed.error


def test_payloads():
    chat = build_payload(RequestInput("u", "m", "hi", 1, 5, chat=True, temperature=0.0, ignore_eos=True,
                                      extra_body={"num_assistant_tokens": 5}))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["max_completion_tokens"] == 5
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert chat["num_assistant_tokens"] == 5 and chat["ignore_eos"] and chat["temperature"] == 0.0
    completion = build_payload(RequestInput("u", "m", "hi", 1, 5))
    assert completion["prompt"] == "hi" and completion["max_tokens"] == 5 and "temperature" not in completion


# --- sweep and tune bookkeeping ---


def point(method: str, k: int, tok_s: float) -> SweepPoint:
    return SweepPoint(method, k, None if k == 0 else 1.5, 1.0 if k == 0 else 1.4, tok_s, 10.0, 3, 0)


def test_tune_picks_where_throughput_stops_improving(tmp_path):
    points = [point("ngram", k, t) for k, t in [(0, 100), (1, 130), (2, 150), (3, 154), (4, 156), (6, 140)]]
    assert pick_num_assistant_tokens(points, tolerance=0.05) == 2   # 150 >= 0.95 * 156
    assert pick_num_assistant_tokens(points, tolerance=0.02) == 3
    assert pick_num_assistant_tokens(points, tolerance=0.0) == 4
    assert pick_num_assistant_tokens([point("x", 0, 100), point("x", 2, 90)], 0.05) == 0
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    backup = write_generation_config(tmp_path, 3)
    assert json.loads(backup.read_text()) == {"eos_token_id": 2}
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 2,
                                                                             "num_assistant_tokens": 3}


def test_tokens_per_step_and_acceptance_from_usage_or_counters():
    drafted = finished(0.0, 0.1, [0.1], output_tokens=7, prompt_len=3)
    drafted.usage = {"completion_tokens": 7, "num_target_forwards": 5, "num_drafts": 4, "num_accepted_tokens": 2}
    from_usage = BenchResult(calculate_metrics([drafted], 1.0), None, [drafted])
    assert tokens_per_target_step(from_usage) == pytest.approx(7 / 5) and acceptance_length(from_usage) == 1.5
    plain = finished(0.0, 0.1, [0.1], output_tokens=7, prompt_len=3)
    counters = spec_decode_stats(SpecCounters(), SpecCounters(2, 4, 3, {0: 2, 1: 1}))
    from_counters = BenchResult(calculate_metrics([plain], 1.0), counters, [plain])
    assert tokens_per_target_step(from_counters) == pytest.approx(7 / 4) and acceptance_length(from_counters) == 2.5
    no_drafts = BenchResult(calculate_metrics([plain], 1.0), None, [plain])
    assert tokens_per_target_step(no_drafts) == 1.0 and acceptance_length(no_drafts) is None


def test_speedups_and_auto_table_use_the_plain_run_of_their_own_block():
    def measured(method, k, tok_s, block):
        return replace(point(method, k, tok_s), block=block, concurrency=1)
    points = [measured("none", 0, 100.0, "a"), measured("a", "auto", 120.0, "a"),
              measured("none", 0, 50.0, "b"), measured("b", 2, 60.0, "b"), measured("b", "auto", 55.0, "b")]
    add_speedups(points)
    assert [p.speedup for p in points] == pytest.approx([1.0, 1.2, 1.0, 1.2, 1.1])
    table = auto_against_fixed(points)
    assert "| a | 1 | 100.0 | - (0.0) | 120.0 |" in table and "| b | 1 | 50.0 | 2 (60.0) | 55.0 | 0.00 | 0.92x |" in table


def test_rounds_go_in_mirrored_pairs_that_cancel_a_steady_drift():
    from specserve.bench.sweep import round_order
    rounds = [round_order([0, 1, 2], r) for r in range(6)]
    assert rounds == [[0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1], [2, 0, 1], [1, 0, 2]]
    for pair in (rounds[0] + rounds[1], rounds[2] + rounds[3]):   # every setting's mean position is the same
        assert len({sum(i for i, s in enumerate(pair) if s == k) for k in range(3)}) == 1
    assert {tuple(r[:1]) for r in rounds[::2]} == {(0,), (1,), (2,)}                 # each setting leads a pair


def test_auto_table_pairs_each_round_with_the_best_setting_of_the_same_round():
    def measured(method, k, runs):
        return replace(point(method, k, sorted(runs)[len(runs) // 2]), block="b", concurrency=2, runs=runs)
    # the machine slowed in round 2: every setting ran slower there, auto less so than the medians say
    points = [measured("none", 0, [50.0, 30.0, 52.0]), measured("b", 2, [60.0, 36.0, 62.0]),
              measured("b", "auto", [59.0, 35.0, 57.0])]
    row = next(line for line in auto_against_fixed(points).splitlines() if line.startswith("| b | 2 |"))
    # medians 57/60; rounds 59/60, 35/36, 57/62; rounds that move by a third leave 0.95 within the noise
    # geometric mean of the rounds' ratios 0.958; Student's t with 2 degrees of freedom for each one-sided 95% end
    assert row.endswith("| 2 (60.0) | 57.0 | 0.00 | 0.95x | 0.96x (0.90-1.02) | within noise | 0.96x (0.90-1.02) | 3 |")
    single = [replace(p, runs=p.runs[:1]) for p in points]
    assert auto_against_fixed(single).splitlines()[-1].endswith("| - | below | - | 1 |")


def test_a_ratio_under_the_goal_is_below_it_only_beyond_the_machines_noise():
    """The auto table's last column: met at 0.97x; under it, "below" only where the ratio's 95% interval, from the
    round-to-round noise pooled over every setting, does not reach 0.97."""
    def rows(spread, auto):
        def measured(method, k, tok_s):
            return replace(point(method, k, tok_s), block="b", concurrency=1,
                           runs=[tok_s * (1 - spread), tok_s, tok_s * (1 + spread)])
        points = [measured("none", 0, 100.0), measured("b", 2, 90.0), measured("b", "auto", auto)]
        return round_noise(points), auto_against_fixed(points).splitlines()[2]
    sigma, row = rows(0.01, 90.0)
    assert sigma == pytest.approx(0.01, rel=0.01) and row.endswith("| 0.90x | 0.90x (0.90-0.90) | below | 1.00x (1.00-1.00) | 3 |")
    assert "| within noise |" in rows(0.2, 90.0)[1] and "| met |" in rows(0.01, 97.5)[1]
    assert "varies by 1.0%" in auto_against_fixed([replace(point("none", 0, 1.0), runs=[0.99, 1.0, 1.01])])


def test_t_quantile_matches_scipy():
    from scipy.stats import t
    for df in (1, 2, 3, 4, 5, 7, 10, 20, 50):
        for p in (0.9, 0.95, 0.975):
            assert t_quantile(p, df) == pytest.approx(t.ppf(p, df), rel=0.003)


def test_the_goal_is_undecided_only_while_an_interval_reaches_across_it():
    def measured(k, runs, concurrency=2):
        return replace(point("m" if k else "none", k, statistics.median(runs)), block="m", concurrency=concurrency,
                       runs=runs)
    plain = measured(0, [100.0, 100.0, 100.0, 100.0])
    assert paired_interval([97.0, 103.0], [100.0, 100.0])[0] == pytest.approx(math.sqrt(0.97 * 1.03))
    assert paired_interval([97.0], [100.0]) is None
    # auto 0.97-1.03x of plain round by round: its interval reaches across 0.97, so more rounds are worth it
    assert undecided(Comparison(measured("auto", [97.0, 103.0, 97.0, 103.0]), plain, None))
    # steady at 1.00x or at 0.90x: decided either way
    assert not undecided(Comparison(measured("auto", [100.0, 100.5, 99.5, 100.0]), plain, None))
    assert not undecided(Comparison(measured("auto", [90.0, 90.5, 89.5, 90.0]), plain, None))
    # at one sequence, against the best fixed k as well: 0.99-1.01x of it round by round is within TIE; 0.975-1.025x
    # over six rounds is clear of 0.97 (the goal at every concurrency) but not within TIE of 1
    best, swings = measured(2, [120.0] * 6, concurrency=1), [117.0, 123.0] * 3
    plain_1 = replace(plain, concurrency=1, runs=[100.0] * 6)
    assert not undecided(Comparison(measured("auto", [118.8, 121.2] * 3, 1), plain_1, best))
    assert undecided(Comparison(measured("auto", swings, 1), plain_1, best))
    assert not undecided(Comparison(measured("auto", swings, 2), replace(plain_1, concurrency=2),
                                    replace(best, concurrency=2)))


def test_sweep_runs_more_rounds_only_where_auto_is_undecided(monkeypatch, capsys):
    """After --repeats rounds at a concurrency the block goes on, all settings interleaved as before, while auto's
    interval there reaches across the goal, and stops at --max-repeats."""
    import argparse
    from dataclasses import dataclass
    from types import SimpleNamespace
    import specserve.bench.sweep as sweep

    @dataclass
    class Config:
        extra_body: dict | None = None
        max_concurrency: int | None = None

    async def prepare(args, base_url):
        return Config(), ["prompt"] * 4, WordTokenizer()
    calls = {}

    async def benchmark(cfg, samples, count):
        key = (cfg.extra_body["num_assistant_tokens"], cfg.max_concurrency)
        calls[key] = calls.get(key, 0) + 1
        return SimpleNamespace(outputs=[], key=key, round=calls[key])

    def point_of(method, k, result, concurrency):
        # at one sequence auto runs 1.3x plain, steadily; at two it swings 0.94-1.00x of plain round by round
        swing = 1.0 if result.round % 2 else 0.94
        tok_s = {0: 100.0, 2: 110.0 if concurrency == 1 else 90.0,
                 "auto": 130.0 if concurrency == 1 else 100.0 * swing}[k]
        return SweepPoint(method, k, None, 1.0, tok_s, 10.0, 4, 0, concurrency, mean_ttft_ms=5.0)
    monkeypatch.setattr(sweep, "prepare", prepare)
    monkeypatch.setattr(sweep, "benchmark", benchmark)
    monkeypatch.setattr(sweep, "point_of", point_of)
    args = argparse.Namespace(concurrency=[1, 2], repeats=2, max_repeats=5, num_prompts=4, prompts_per_concurrency=None)
    points = asyncio.run(measure_block(args, [Target("m", "url", [0, 2, "auto"])], "m"))
    assert calls == {(k, 1): 2 for k in (0, 2, "auto")} | {(k, 2): 5 for k in (0, 2, "auto")}
    assert [len(p.runs) for p in points] == [2, 2, 2, 5, 5, 5]
    out = capsys.readouterr().out
    assert "concurrency=2 round 3 of at most 5 (goal undecided)" in out and "concurrency=1 round 3" not in out


def test_sweep_table_and_files(tmp_path):
    points = [point("none", 0, 100.0), replace(point("ngram", 2, 150.0), mean_ttft_ms=81.25), point("ngram", 4, 120.0)]
    add_speedups(points)
    assert [p.speedup for p in points] == pytest.approx([1.0, 1.5, 1.2])
    table = format_table(points)
    assert "speedup" in table.splitlines()[0] and "TTFT ms" in table.splitlines()[0] and "1.50x" in table
    assert table.splitlines()[3].split()[6] == "81.2" and table.splitlines()[2].split()[6] == "-"
    paths = write_results(points, tmp_path)
    assert [p.name for p in paths] == ["sweep.csv", "sweep.json", "sweep.png"]
    assert "mean_ttft_ms" in paths[0].read_text().splitlines()[0]
    assert paths[2].read_bytes()[:4] == b"\x89PNG" and len(json.loads(paths[1].read_text())) == 3



def test_concurrency_plot_has_a_panel_per_method_with_plain_in_each(tmp_path):
    """Plain is measured inside every method's block: a panel shows its own block's runs, else all of them."""
    points = [replace(point(m, k, t), concurrency=c) for m, k, t, c in [
        ("none", 0, 100.0, 1), ("ngram", 2, 150.0, 1), ("ngram", "auto", 160.0, 1), ("none", 0, 90.0, 1),
        ("eagle3", "auto", 95.0, 1), ("none", 0, 200.0, 4), ("ngram", 2, 180.0, 4), ("ngram", "auto", 210.0, 4),
        ("none", 0, 220.0, 4), ("eagle3", "auto", 215.0, 4), ("none", 0, 80.0, 1)]]
    panels = concurrency_lines(points)
    assert list(panels) == ["ngram", "eagle3"]
    assert concurrency_lines([replace(p, block="eagle3") if p.output_throughput in (80.0, 220.0) else p
                              for p in points])["eagle3"]["plain"] == ([1, 4], [80.0, 220.0])
    assert list(panels["ngram"]) == ["plain", "k=2", "k=auto"] and list(panels["eagle3"]) == ["plain", "k=auto"]
    assert panels["eagle3"]["plain"] == ([1, 4], [90.0, 210.0])
    assert panels["ngram"]["k=auto"] == ([1, 4], [160.0, 210.0])
    plot_concurrency(points, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert list(concurrency_lines(points[:1])) == ["plain decoding"]

# --- the CLI against a fake OpenAI-compatible server ---


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["bench", "serve", "--extra-body", "[1]"], "argument --extra-body: must be a JSON object"),
    (["bench", "serve", "--request-rate", "0"], "argument --request-rate: must be positive"),
    (["bench", "serve", "--dataset-name", "jsonl"], "--dataset-path is required"),
    (["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat"),
    (["bench", "sweep", "--methods", "ngram,magic"], "argument --methods: unknown method(s) magic"),
    (["bench", "sweep", "--methods", "ngram", "--model", "no/such/dir"], "--model must be a local model directory"),
    (["bench", "sweep", "--num-assistant-tokens", "1,x"], "argument --num-assistant-tokens"),
    (["bench", "sweep", "--repeats", "4", "--max-repeats", "3"], "--max-repeats 3 is under --repeats 4"),
    (["tune", "--tolerance", "2"], "argument --tolerance"),
])
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        args = parse(argv)
        args.func(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_sweep_and_tune_launch_the_default_model_without_model(monkeypatch, capsys, tmp_path):
    """As `specserve serve` with no model: the launched servers run the default model; if it is not installed,
    the error says how to install it."""
    import specserve.bench.cli as bench_cli
    monkeypatch.setattr(bench_cli, "default_model_dir", lambda: tmp_path)
    seen = []
    run = bench_cli.checked(build_parser(), seen.append, needs_model_dir=lambda args: True)
    for argv in (["bench", "sweep", "--methods", "ngram"], ["tune"]):
        assert run(parse(argv)) == 0 and seen[-1].model == str(tmp_path)

    def not_installed():
        raise FileNotFoundError("the default model, SmolLM2, is not installed: run `pip install ...`")
    monkeypatch.setattr(bench_cli, "default_model_dir", not_installed)
    args = parse(["bench", "sweep", "--methods", "ngram"])
    with pytest.raises(SystemExit) as exit_info:
        args.func(args)
    assert exit_info.value.code == 2 and "--model: none given, and the default model" in capsys.readouterr().err


def fake_server_app():
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse, StreamingResponse

    app, counters = FastAPI(), {"drafts": 0, "draft_tokens": 0, "accepted": 0, "pos0": 0, "pos1": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "root": None}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {counters["drafts"]}\n'
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {counters["draft_tokens"]}\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {counters["accepted"]}\n'
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {counters["pos0"]}\n'
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} {counters["pos1"]}\n')

    async def stream(body: dict, chat: bool):
        for word in ["Shall", " I", " compare", " thee"]:
            await asyncio.sleep(0.005)
            choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        # each request: 2 drafts of 2 tokens, 3 accepted (2 at position 0, 1 at position 1) -> 7 tokens
        for key, n in [("drafts", 2), ("draft_tokens", 4), ("accepted", 3), ("pos0", 2), ("pos1", 1)]:
            counters[key] += n
        usage = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return StreamingResponse(stream(await request.json(), chat=False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return StreamingResponse(stream(await request.json(), chat=True), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake_server_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_bench_serve_cli_against_fake_server(fake_server, tmp_path, capsys):
    prompts, result_file = tmp_path / "p.jsonl", tmp_path / "result.json"
    prompts.write_text('{"prompt": "hello there"}\n')
    args = parse(["bench", "serve", "--base-url", fake_server, "--backend", "openai-chat",
                  "--dataset-name", "jsonl", "--dataset-path", str(prompts), "--num-prompts", "3",
                  "--max-concurrency", "1", "--extra-body", '{"num_assistant_tokens": 2}',
                  "--save-result", str(result_file), "--disable-tqdm",
                  "--tokenizer", str(word_tokenizer_dir(tmp_path))])
    result = run_serve(args)
    text = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in text
    assert result["completed"] == 3 and result["total_output_tokens"] == 21 and result["output_throughput"] > 0
    assert result["total_input_tokens"] == 33   # from usage.prompt_tokens
    assert result["spec_decode_acceptance_length"] == pytest.approx(2.5)
    assert result["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 0.5])
    assert "Acceptance length:                       2.50" in text
    assert json.loads(result_file.read_text())["model_id"] == "fake-model"


def test_bench_sweep_cli_against_fake_server(fake_server, tmp_path, capsys):
    args = parse(["bench", "sweep", "--base-url", fake_server, "--dataset-name", "random",
                  "--random-input-len", "16", "--output-len", "4", "--num-prompts", "2",
                  "--num-assistant-tokens", "0,2", "--result-dir", str(tmp_path / "out"), "--disable-tqdm",
                  "--tokenizer", str(word_tokenizer_dir(tmp_path)), "--repeats", "3"])
    points = run_sweep(args)
    assert [p.num_assistant_tokens for p in points] == [0, 2]
    assert all(len(p.runs) == 3 and p.output_throughput == statistics.median(p.runs) for p in points)
    out = capsys.readouterr().out            # rounds interleave the settings: A B, B A, then B A (rotated by one)
    order = re.findall(r"num_assistant_tokens=(\d) concurrency=1 round (\d)/3", out)
    assert order == [("0", "1"), ("2", "1"), ("2", "2"), ("0", "2"), ("2", "3"), ("0", "3")]
    assert points[1].tokens_per_step == pytest.approx(7 / 4)   # 7 tokens, 3 of them accepted drafts
    assert all(p.mean_ttft_ms > 0 for p in points) and "TTFT" in out
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"sweep.csv", "sweep.json", "sweep.png"}
    assert "speedup" in out


def word_tokenizer_dir(tmp_path: Path) -> Path:
    """A tiny Hugging Face tokenizer directory for specserve.tokenizer: word-level, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    path = tmp_path / "tok"
    if path.is_dir():
        return path
    path.mkdir()
    words = ["<unk>", "<s>", "hello", "there", "Shall", "I", "compare", "thee"] + [f"w{i}" for i in range(40)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return path
