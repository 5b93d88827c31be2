"""Prometheus metrics under vLLM's names, so its dashboards and `vllm bench serve` read them unchanged.

Each app has its own CollectorRegistry. A request's counts are added once, when it leaves the engine
(finished or aborted), from the same snapshot its response's usage is built from.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.engine.async_engine import AsyncEngine
from specserve.runtime.sequence import SeqSnapshot

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        labels, model = ["model_name"], {"model_name": model_name}
        reg = self.registry
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps that checked a draft.",
                                  labels, registry=reg).labels(**model)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                        labels, registry=reg).labels(**model)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           labels, registry=reg).labels(**model)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft.",
                                        labels + ["position"], registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=reg).labels(**model)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=reg).labels(**model)
        self.request_success = Counter("vllm:request_success", "Requests that left the engine, by finish reason.",
                                       labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=reg).labels(**model)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", labels,
                              buckets=TPOT_BUCKETS, registry=reg).labels(**model)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=E2E_BUCKETS, registry=reg).labels(**model)
        Gauge("vllm:num_requests_running", "Requests in the running batch.", labels,
              registry=reg).labels(**model).set_function(lambda: engine.load.num_running)
        Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels,
              registry=reg).labels(**model).set_function(lambda: engine.load.num_waiting)
        Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", labels,
              registry=reg).labels(**model).set_function(lambda: engine.load.kv_cache_usage)
        Gauge("specserve:spec_decode_mean_draft_length", "Draft length chosen per decoding sequence, recent steps "
              "(decayed).", labels, registry=reg).labels(**model).set_function(lambda: engine.load.mean_draft_length)
        Gauge("specserve:spec_decode_drafting_fraction", "Fraction of decoding sequences drafting, recent steps "
              "(decayed).", labels, registry=reg).labels(**model).set_function(lambda: engine.load.drafting_fraction)
        self.model = model
        engine.add_finish_listener(self.record_finished)

    def record_finished(self, seq: SeqSnapshot) -> None:
        spec = seq.spec
        self.num_drafts.inc(spec.num_drafts)
        self.num_draft_tokens.inc(spec.num_draft_tokens)
        self.num_accepted_tokens.inc(spec.num_accepted_tokens)
        for position, n in enumerate(spec.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position), **self.model).inc(n)
        self.prompt_tokens.inc(seq.num_prompt_tokens)
        self.generation_tokens.inc(seq.num_output_tokens)
        self.request_success.labels(finished_reason=seq.finish_reason or "abort", **self.model).inc()
        if seq.first_token_time is None:
            return
        end = time.perf_counter()
        self.ttft.observe(seq.first_token_time - seq.arrival_time)
        self.e2e.observe(end - seq.arrival_time)
        if seq.num_output_tokens > 1:
            self.tpot.observe((end - seq.first_token_time) / (seq.num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
