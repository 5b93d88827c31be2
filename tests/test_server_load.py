"""Issue 12: load on a live server (127.0.0.1): 64 concurrent streaming clients, chat and text completions,
plain, chain and tree drafting, greedy and seeded sampling (negative seeds too); every eighth client
disconnects after two chunks. Each stream must carry exactly its own request's tokens: every chunk names
that request, its prompt is the client's, its text is what the engine produced for it, none lost or
repeated. The engine must end empty with every KV block free; the RSS after each round is reported.

The streams are also compared with the same requests run alone offline. That comparison reports how many
agree and tolerates a few that do not: linears pick their kernel per row bucket (layers/linear.py), and an
fp32 kernel agrees with another only to rounding, so a near-tie may go another way in a batch of 30 than alone.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from specserve.config import EngineConfig, demo_model_dir
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.llm_engine import LLMEngine
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.server.api_server import build_app
from test_server import LiveServer

DEMO = demo_model_dir()
# float32, whose streams agree with the lone runs far more often than bfloat16 ones here
ENGINE = dict(speculative_method="eagle3", draft_model=DEMO / "eagle3", kv_cache_memory_gb=0.05, max_model_len=512, dtype="float32",
              max_num_seqs=32)
NUM_CLIENTS = 64
ROUNDS = 2                      # the RSS check compares the last round with the first
PROMPTS = ["def fibonacci(n):", "To be, or not to be, that is the question:", "The quick brown fox",
           "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "The capital of France is",
           "for i in range(10):", "Once upon a time"]
METHODS = [{"num_assistant_tokens": 0}, {"num_assistant_tokens": 4},
           {"num_assistant_tokens": 8, "branching_factor": 2, "tree_depth": 4}]


def request_of(i: int) -> tuple[str, dict]:
    """Client i's endpoint and body: the mix cycles with different periods, so neighbours differ."""
    sampling = {"temperature": 0} if i % 4 < 2 else {"temperature": 0.8, "seed": (1000 + i) * (-1) ** i}
    body = {"max_tokens": 12 + i % 9, "ignore_eos": True, "stream": True, **METHODS[i % 3], **sampling}
    prompt = f"{PROMPTS[i % len(PROMPTS)]} {i}"
    if i % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def disconnects(i: int) -> bool:
    return i % 8 == 7


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine(LLMEngine(EngineConfig(model=DEMO, **ENGINE)))
    with LiveServer(build_app(engine, "demo")) as live:
        live.engine = engine
        yield live


@pytest.fixture(scope="module")
def expected() -> list[tuple[str, int]]:
    """Each client's text and token count, from an offline engine running that request alone."""
    llm = LLM(str(DEMO), **ENGINE)
    out = []
    for i in range(NUM_CLIENTS):
        path, body = request_of(i)
        params = SamplingParams.from_dict({**{k: body[k] for k in ("temperature", "max_tokens", "ignore_eos",
                                                                    *METHODS[i % 3])}, "seed": body.get("seed")})
        result = (llm.chat(body["messages"], params) if "messages" in body else llm.generate(body["prompt"], params))[0]
        out.append((result.outputs[0].text, len(result.outputs[0].token_ids)))
    return out


async def one_client(http: httpx.AsyncClient, i: int) -> dict:
    """What client i saw: the text, the request ids its chunks named, the usage, whether [DONE] arrived."""
    path, body = request_of(i)
    body = {**body, "stream_options": {"include_usage": True}}
    seen = {"text": "", "ids": set(), "usage": None, "done": False}
    chunks = 0
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                seen["done"] = True
                break
            event = json.loads(data)
            assert "error" not in event, event
            seen["ids"].add(event["id"])
            if event["choices"]:
                choice = event["choices"][0]
                seen["text"] += choice["delta"].get("content", "") if "delta" in choice else choice["text"]
                chunks += 1
            if event.get("usage"):
                seen["usage"] = event["usage"]
            if disconnects(i) and chunks == 3:                  # the role chunk and two of text, for a chat
                break                                           # leaving closes the connection mid-stream
    return seen


async def round_of_clients(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.gather(*(one_client(http, i) for i in range(NUM_CLIENTS)))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def wait_idle(server, timeout: float = 20.0) -> None:
    engine, async_engine = server.engine.engine, server.engine
    deadline = time.time() + timeout
    while (engine.requests or engine.block_manager.num_free_blocks != engine.block_manager.num_blocks
           or async_engine.num_in_flight or async_engine.load.kv_cache_usage):
        assert time.time() < deadline, (len(engine.requests), async_engine.num_in_flight, async_engine.load)
        time.sleep(0.05)


def prompt_ids(tokenizer, i: int) -> list[int]:
    _, body = request_of(i)
    if "messages" in body:
        return tokenizer.encode(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True),
                                add_special_tokens=False)
    return tokenizer.encode(body["prompt"])


def test_sixty_four_streaming_clients(server, expected, capsys):
    engine = server.engine.engine
    finished: dict[str, tuple[list[int], str, int, str]] = {}      # request id -> what the engine did with it
    server.engine.add_finish_listener(lambda seq: finished.__setitem__(
        seq.request_id, (list(seq.prompt_token_ids), seq.output_text, seq.num_output_tokens,
                         seq.finish_reason)))
    rss, agree = [], []
    start = time.perf_counter()
    for _ in range(ROUNDS):
        finished.clear()
        results = asyncio.run(round_of_clients(server.url))
        wait_idle(server)
        deadline = time.time() + 5                              # listeners run just after a request's slot frees
        while len(finished) < NUM_CLIENTS and time.time() < deadline:
            time.sleep(0.01)
        assert len(finished) == NUM_CLIENTS
        for i, seen in enumerate(results):
            max_tokens = request_of(i)[1]["max_tokens"]
            assert len(seen["ids"]) == 1, f"client {i} got chunks of {seen['ids']}"
            prompt, text, num_tokens, reason = finished[seen["ids"].pop()]
            assert prompt == prompt_ids(engine.tokenizer, i), f"client {i} got another prompt's stream"
            if disconnects(i):
                assert not seen["done"] and reason == "abort" and text.startswith(seen["text"]), f"client {i}"
                continue
            assert seen["done"] and reason == "length" and seen["text"] == text, f"client {i}: {seen['text']!r} != {text!r}"
            assert seen["usage"]["completion_tokens"] == num_tokens == max_tokens, f"client {i}"
            agree.append(text == expected[i][0])
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not engine.requests and not engine.detokenizers and not server.engine._streams
        assert not engine.proposer.states                       # the EAGLE3 head kept nothing of finished requests
        rss.append(rss_mb())
    elapsed = time.perf_counter() - start
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'vllm:kv_cache_usage_perc{model_name="demo"} 0.0' in metrics
    with capsys.disabled():
        print(f"\nload: {ROUNDS} rounds of {NUM_CLIENTS} streaming clients in {elapsed:.1f} s; {sum(agree)} of "
              f"{len(agree)} completed streams equal their request run alone; RSS after each round "
              f"{', '.join(f'{r:.0f}' for r in rss)} MB (growth after the first round {rss[-1] - rss[0]:+.1f} MB)")
    assert sum(agree) >= 0.9 * len(agree)       # a few near-ties may go another way; cross-talk would be most
    assert rss[-1] - rss[0] < 300         # new batch shapes fill oneDNN's primitive cache (1024 entries) first
