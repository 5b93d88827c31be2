"""Issue 12, one regression test per defect, against a live server on 127.0.0.1: each bad request gets its
OpenAI-shaped error, and the server stays healthy and keeps answering the requests that follow it."""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from specserve.config import EngineConfig, demo_model_dir
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.llm_engine import LLMEngine
from specserve.llm import LLM
from specserve.sampling_params import MAX_STOP_STRINGS, MAX_TEMPERATURE, SamplingParams
from specserve.server.api_server import build_app, check_dtype_supported, run_server
from specserve.server.cli import add_serve_parser, resolve_serve_args
from specserve.drafting.tree import MAX_TREE_NODES
from test_server import LiveServer

NAME = "demo"
DEMO = demo_model_dir()
# the demo target with its EAGLE3 head: the drafter whose tree requests and draft vocabulary (2048) matter here
ENGINE = dict(model=DEMO, speculative_method="eagle3", draft_model=DEMO / "eagle3", kv_cache_memory_gb=0.02,
              max_model_len=512, max_num_seqs=8)
PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine(LLMEngine(EngineConfig(**ENGINE)))
    with LiveServer(build_app(engine, NAME, max_request_bytes=1 << 20)) as live:
        live.engine = engine
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(str(DEMO), **{k: v for k, v in ENGINE.items() if k != "model"})


def post(server, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, **kwargs)
    return httpx.post(f"{server.url}{path}", json=body, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, match: str = "") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert match.lower() in error["message"].lower(), error
    return error


def assert_serving(server, client) -> None:
    """Healthy, idle (no request left in the engine, every KV block free), and answering a request exactly."""
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    engine = server.engine.engine
    deadline = time.time() + 10
    while engine.requests or engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        assert time.time() < deadline, f"{len(engine.requests)} requests still in the engine"
        time.sleep(0.02)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == reference_text()


_reference: list[str] = []


def reference_text() -> str:
    """The demo target's greedy 8 tokens after PROMPT, from the first healthy request (an offline engine
    on the same weights agrees: test_failing_step_fails_only_its_requests checks it)."""
    return _reference[0]


@pytest.fixture(scope="module", autouse=True)
def first_answer(server):
    out = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert out.status_code == 200
    _reference.append(out.json()["choices"][0]["text"])


# ---- 1. seed -1 with temperature > 0 ---------------------------------------------------------------

def test_seed_minus_one_samples_and_the_engine_lives_on(server, client):
    kwargs = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    texts = [client.completions.create(seed=seed, **kwargs).choices[0].text for seed in (-1, -1, (1 << 64) - 1)]
    assert texts[0] == texts[1] == texts[2] and texts[0]       # -1 is 2**64 - 1 modulo 2**64, as a seed
    streamed = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0.7,
                                              seed=-(1 << 63), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed)
    huge = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 10 ** 40})
    assert huge.status_code == 200
    assert_serving(server, client)


# ---- 2. branching_factor above the head's draft vocabulary -----------------------------------------

def test_branching_factor_over_the_draft_vocabulary_is_a_400(server, client):
    body = {"prompt": PROMPT, "max_tokens": 8, "num_assistant_tokens": 4, "branching_factor": 2049, "tree_depth": 2}
    assert_openai_error(post(server, COMPLETIONS, body), 400, match="draft vocabulary (2048 tokens)")
    with pytest.raises(openai.BadRequestError, match="draft vocabulary"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4,
                                       extra_body={"branching_factor": 5000, "tree_depth": 1})
    assert_serving(server, client)


# ---- 3. unbounded tree width -----------------------------------------------------------------------

def test_tree_width_is_capped(server, client):
    body = {"prompt": PROMPT, "max_tokens": 8, "num_assistant_tokens": 32, "branching_factor": 1000, "tree_depth": 32}
    start = time.perf_counter()
    assert_openai_error(post(server, COMPLETIONS, body), 400, match=f"at most {MAX_TREE_NODES}")
    assert time.perf_counter() - start < 5                      # refused at admission, not after 21 s of drafting
    # a tree just under the cap: 8 + 8 * 8 * 15 = 968 nodes, depth 16, 32 verified
    widest = {"num_assistant_tokens": 32, "branching_factor": 8, "tree_depth": 16}
    assert 8 + 64 * 15 <= MAX_TREE_NODES < 9 + 81 * 15
    tree = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **widest}).json()
    assert tree["choices"][0]["text"] == reference_text()       # greedy tree output == greedy plain output
    assert tree["usage"]["num_draft_tokens"] > 0
    assert_openai_error(post(server, COMPLETIONS, {"prompt": PROMPT, **widest, "branching_factor": 9}), 400,
                        match="grows")


def test_a_widest_tree_request_delays_a_short_one_by_a_share_of_a_step(server, client):
    """The defect: a concurrent 8-token request took 20.7 s (0.13 s alone) beside one tree request."""
    alone = min(timed_completion(server, {}) for _ in range(3))
    widest = {"num_assistant_tokens": 32, "branching_factor": 8, "tree_depth": 16, "max_tokens": 64, "ignore_eos": True}
    result: list[float] = []
    tree = threading.Thread(target=lambda: result.append(timed_completion(server, widest)))
    tree.start()
    time.sleep(0.05)
    beside = timed_completion(server, {})
    tree.join()
    print(f"\n8-token request: {alone:.3f} s alone, {beside:.3f} s beside the widest tree ({result[0]:.3f} s)")
    assert beside < 20 * alone + 1.0
    assert_serving(server, client)


def timed_completion(server, extra: dict) -> float:
    start = time.perf_counter()
    response = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return time.perf_counter() - start


# ---- 4. a large body, and tokenization on the event loop -------------------------------------------

def test_a_body_over_the_limit_gets_413_unread(server, client):
    big = json.dumps({"prompt": "a " * (3 << 20)}).encode()    # 6 MiB, the limit here is 1 MiB
    start = time.perf_counter()
    assert_openai_error(post(server, COMPLETIONS, big), 413, match="limit of 1048576 bytes")
    assert time.perf_counter() - start < 5

    def chunks():                                               # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b"x" * 65536

    chunked = httpx.post(f"{server.url}{COMPLETIONS}", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(chunked, 413)
    assert_serving(server, client)


def test_tokenizing_a_large_prompt_leaves_the_event_loop_free(server, client):
    prompt = "the quick brown fox " * 50_000                 # 1 MB of text, just under the limit: ~200k tokens
    latencies: list[float] = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            start = time.perf_counter()
            assert httpx.get(f"{server.url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    start = time.perf_counter()
    prober.start()
    responses = [post(server, path, body) for path, body in [
        (COMPLETIONS, {"prompt": prompt[:-30], "max_tokens": 1}),
        (CHAT, {"messages": [{"role": "user", "content": prompt[:-100]}], "max_tokens": 1}),
        ("/tokenize", {"prompt": prompt[:-30]})]]
    elapsed = time.perf_counter() - start
    done.set()
    prober.join()
    for response in responses[:2]:
        assert_openai_error(response, 400, match="tokens")     # far longer than the context: refused after tokenizing
    assert responses[2].status_code == 200 and responses[2].json()["count"] > 100_000
    print(f"\n3 MB of prompts tokenized in {elapsed:.2f} s; /health answered {len(latencies)} times meanwhile, "
          f"slowest {max(latencies):.3f} s")
    # Tokenizing holds no lock the event loop needs (test_tokenizer checks the GIL is released). A loop blocked by
    # each tokenization would answer a few times in all (each /health waiting out a third of `elapsed`); a free one
    # answers every ~50 ms here (36 times in 1.8 s). Counting the answers, not bounding the slowest, lets one
    # scheduling hiccup of the shared host pass (a 0.61 s /health once failed a 0.5 s bound).
    assert len(latencies) >= max(4, elapsed / 0.25)
    assert_serving(server, client)


# ---- 5. lone surrogates ----------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}', "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
    (COMPLETIONS, b'{"prompt": "a", "stop": ["\\ud800"]}', "stop"),
], ids=["completions", "chat", "chat part", "tokenize", "tokenize chat", "stop"])
def test_lone_surrogates_are_a_400(server, client, path, body, param):
    assert_openai_error(post(server, path, body), 400, param, match="surrogate")
    assert_serving(server, client)


def test_a_surrogate_pair_is_one_character(server):
    response = post(server, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')      # U+1F600, escaped as a pair
    assert response.status_code == 200 and response.json()["count"] > 0
    unknown = post(server, COMPLETIONS, b'{"model": "\\ud800", "prompt": "a"}')   # echoed in the message
    assert_openai_error(unknown, 404, "model")


# ---- 6. what OpenAI or vLLM reject, and what they accept -------------------------------------------

REJECTED = [
    ("a tool that is not a function", CHAT, {"messages": MESSAGES, "tools": [{"type": "retrieval"}]}, "tools.0.type",
     "function"),
    ("tool_choice required without tools", CHAT, {"messages": MESSAGES, "tool_choice": "required"}, None, "needs tools"),
    ("functions (deprecated)", CHAT, {"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions", ""),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0", "unknown role"),
    ("tool message without an id", CHAT, {"messages": [{"role": "tool", "content": "4"}]}, "messages.0", "tool_call_id"),
    ("content null", CHAT, {"messages": [{"role": "user", "content": None}]}, "messages.0", "content"),
    ("content missing", CHAT, {"messages": [{"role": "system"}]}, "messages.0", "content"),
    ("assistant null content without tool_calls", CHAT,
     {"messages": [{"role": "assistant", "content": None}, *MESSAGES]}, "messages.0", "content"),
    ("tool_calls on a user message", CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages.0", "tool_calls"),
    ("role not a string", CHAT, {"messages": [{"role": 1, "content": "x"}]}, "messages.0.role", ""),
    ("stop_token_ids out of the vocabulary", COMPLETIONS, {"prompt": "a", "stop_token_ids": [4096]}, None,
     "stop_token_ids out of the vocabulary"),
    ("negative stop_token_ids", COMPLETIONS, {"prompt": "a", "stop_token_ids": [-1]}, None, "stop_token_ids"),
    ("1000 stop strings", COMPLETIONS, {"prompt": "a", "stop": [f"s{i}" for i in range(1000)]}, "stop",
     f"at most {MAX_STOP_STRINGS}"),
    ("a long stop string", COMPLETIONS, {"prompt": "a", "stop": "x" * 1000}, "stop", "characters"),
    ("1000 stop_token_ids", COMPLETIONS, {"prompt": "a", "stop_token_ids": [3] * 1000}, "stop_token_ids", "at most"),
    ("temperature 1e300", COMPLETIONS, {"prompt": "a", "temperature": 1e300}, "temperature", f"less than or equal to {MAX_TEMPERATURE:g}"),
    ("temperature just over the maximum", CHAT, {"messages": MESSAGES, "temperature": 2.0001}, "temperature", ""),
    ("max_tokens 5.5", COMPLETIONS, {"prompt": "a", "max_tokens": 5.5}, "max_tokens", "integer"),
    ("max_tokens true", COMPLETIONS, {"prompt": "a", "max_tokens": True}, "max_tokens", ""),
    ("token ids as fractional floats", COMPLETIONS, {"prompt": [1.5, 2.0]}, None, ""),
    ("detokenize out of the vocabulary", "/detokenize", {"tokens": [1, 5000]}, "tokens", "vocabulary"),
]


@pytest.mark.parametrize("case", REJECTED, ids=[c[0] for c in REJECTED])
def test_what_openai_rejects_is_a_400(server, client, case):
    _, path, body, param, match = case
    assert_openai_error(post(server, path, body), 400, param, match)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_integral_floats_and_tool_results_are_accepted(server, client):
    out = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 5.0, "temperature": 0, "top_k": 40.0,
                                     "seed": 3.0, "num_assistant_tokens": 2.0, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 5
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    as_floats = post(server, COMPLETIONS, {"prompt": [float(t) for t in ids], "max_tokens": 8, "temperature": 0})
    assert as_floats.json()["choices"][0]["text"] == reference_text()
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [float(t) for t in ids]}).json()["prompt"] == PROMPT
    history = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    chat = client.chat.completions.create(model=NAME, messages=history, max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert post(server, COMPLETIONS, {"prompt": "a", "max_tokens": 2, "temperature": 1e-300}).status_code == 200
    assert post(server, COMPLETIONS, {"prompt": "a", "max_tokens": 2, "top_k": 10 ** 30}).status_code == 200
    assert_serving(server, client)


def test_bearer_is_case_insensitive(qwen3_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=qwen3_dir, kv_cache_memory_gb=0.004, speculative_method="none")))
    with LiveServer(build_app(engine, "m", api_key="sekret")) as live:
        body = {"prompt": "def", "max_tokens": 2}
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR "):
            ok = httpx.post(f"{live.url}{COMPLETIONS}", json=body, headers={"Authorization": f"{scheme} sekret"})
            assert ok.status_code == 200, scheme
        for header in ("Basic sekret", "Bearer", "Bearer sekret2", "sekret", "Bearer s\u00e9kret"):
            denied = httpx.post(f"{live.url}{COMPLETIONS}", json=body, headers={"Authorization": header.encode()})
            assert_openai_error(denied, 401)
        client = live.client(api_key="sekret")
        assert client.completions.create(model="m", prompt="def", max_tokens=2).choices[0].text is not None


# ---- 7. errors and responses in OpenAI's shape ----------------------------------------------------

@pytest.mark.parametrize("body, match", [
    (b'{"prompt": "caf\xe9"}', "UTF-8"),                       # Latin-1, not UTF-8
    (b'\xff\xfe{}', ""),
    (b'[' * 5000 + b']' * 5000, ""),                            # nested deeper than Python's JSON parser goes
    (b'{"prompt": "a", "max_tokens": 1' + b'0' * 5000 + b'}', ""),  # an integer with more digits than Python parses
    (b'{"prompt": "a", "temperature": NaN}', "temperature"),
    (b'{"prompt": "a", "temperature": Infinity}', "temperature"),
    (b'', ""),
    (b'"just a string"', "JSON object"),
], ids=["latin-1", "bom", "deep", "huge int", "nan", "inf", "empty", "string"])
def test_body_parse_errors_get_openai_errors(server, client, body, match):
    error = assert_openai_error(post(server, COMPLETIONS, body), 400, match=match)
    assert "detail" not in error
    assert_serving(server, client)


def test_a_body_not_sent_as_json_is_told_so(server):
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        response = httpx.post(f"{server.url}{COMPLETIONS}", content=b'{"prompt": "a"}',
                              headers={"content-type": content_type})
        assert_openai_error(response, 400, match="Content-Type: application/json")


def test_a_deep_unknown_field_is_ignored(server):
    deep = b'{"prompt": "a", "max_tokens": 2, "x": ' + b'[{"y": ' * 400 + b'1' + b'}]' * 400 + b'}'
    assert post(server, COMPLETIONS, deep).status_code == 200


def test_405_names_the_allowed_methods_and_health_has_a_body(server):
    response = httpx.get(f"{server.url}{COMPLETIONS}")
    assert_openai_error(response, 405, match="allowed: POST")
    assert response.headers["allow"] == "POST"
    assert httpx.delete(f"{server.url}/health").headers["allow"] == "GET"
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.headers["content-type"] == "application/json"
    assert health.json() == {"status": "ok"}


def test_chat_stream_sends_the_role_first(server, client):
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True))
    first, *rest = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert rest and all(c.choices[0].delta.role is None for c in rest)


# ---- fault isolation: a step that raises, and a thread that dies ----------------------------------

POISON = 7          # a prompt starting with this token makes the injected fault fire in its first step


def test_failing_step_fails_only_its_requests(server, client, offline, monkeypatch):
    assert offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text == reference_text()
    engine = server.engine.engine
    forward = engine.runner.forward

    def faulty(items, aux_layers):
        if any(item.start == 0 and item.token_ids[0] == POISON for item in items):
            raise RuntimeError("injected fault")
        return forward(items, aux_layers)

    monkeypatch.setattr(engine.runner, "forward", faulty)
    victim = {"prompt": [POISON, 500, 600, 700], "max_tokens": 8}
    error = assert_openai_error(post(server, COMPLETIONS, victim), 500, match="injected fault")
    assert error["type"] == "internal_server_error"
    assert_serving(server, client)

    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json={**victim, "prompt": [POISON, 9], "stream": True}) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "injected fault" in error["message"]
    # a chat stream that fails: its role chunk, then the error, which the openai client raises
    def always(items, aux_layers):
        raise RuntimeError("every step fails")

    monkeypatch.setattr(engine.runner, "forward", always)
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, stream=True)
    assert next(iter(stream)).choices[0].delta.role == "assistant"
    with pytest.raises(openai.APIError, match="every step fails"):
        list(stream)
    monkeypatch.setattr(engine.runner, "forward", forward)
    assert_serving(server, client)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'finished_reason="error"' in metrics


def test_engine_thread_death_exits_the_process(qwen3_dir):
    """A fault outside a step's isolation (here an injected scheduler defect) stops the engine thread:
    the waiting client gets a 500, and the server process exits with status 1 for its supervisor."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("import sys\n"
              "from specserve.engine.scheduler import Scheduler\n"
              "def broken(self, *args):\n"
              "    raise RuntimeError('injected scheduler defect')\n"
              "Scheduler.schedule = broken\n"
              "from specserve.server.cli import main\n"
              f"main(['serve', {str(qwen3_dir)!r}, '--port', '{port}', '--kv-cache-memory-gb', '0.004',"
              " '--speculative-method', 'none'])\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port)
        response = httpx.post(f"http://127.0.0.1:{port}{COMPLETIONS}", json={"prompt": "def", "max_tokens": 4})
        assert_openai_error(response, 500, match="engine stopped")
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    assert "injected scheduler defect" in out and "exiting with status 1" in out


def wait_healthy(proc: subprocess.Popen, port: int) -> None:
    deadline = time.time() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "the server did not start"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)


# ---- 9. --dtype bfloat16 on a CPU without bf16 kernels ---------------------------------------------

def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve")
    serve = add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return resolve_serve_args(parser.parse_args(["serve", *argv]), serve)


def test_bf16_without_cpu_kernels_cannot_start(monkeypatch, capsys):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with pytest.raises(SystemExit) as exit:
        run_server(serve_args([str(DEMO), "--dtype", "bfloat16", "--device", "cpu", "--port", "0"]))
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("specserve serve: cannot start: --dtype bfloat16 needs bfloat16 CPU kernels")
    assert "Traceback" not in err
    for dtype in ("float32", "float16", "auto"):           # only bfloat16 is refused
        check_dtype_supported(dtype, "cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    check_dtype_supported("bfloat16", "cpu")


def test_max_request_bytes_flag(monkeypatch):
    assert serve_args([]).max_request_bytes == 4 << 20
    assert serve_args(["--max-request-bytes", "1000"]).max_request_bytes == 1000
    with pytest.raises(SystemExit):
        serve_args(["--max-request-bytes", "0"])


# ---- bounded work: draft tokens count against the step's token budget ----------------------------

def test_draft_tokens_stay_within_the_step_budget(tmp_path, qwen3_dir):
    """Four decoding sequences asking 8 draft tokens each, under a 12-token budget: each forward holds at
    most 12 tokens (4 of them the sequences' own), and the greedy output is the unbounded engine's. The
    drafter is the target itself, so that every step drafts all the slots it is given."""
    shutil.copytree(qwen3_dir, tmp_path / "draft")
    config = dict(model=qwen3_dir, kv_cache_memory_gb=0.004, speculative_method="draft", draft_model=tmp_path / "draft",
                  max_num_seqs=4)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [12, 13, 12, 13, 12], [20, 21, 22, 20, 21, 22]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, num_assistant_tokens=8)
    outputs = []
    for budget in (12, 2048):
        engine = LLMEngine(EngineConfig(max_num_batched_tokens=budget, **config))
        sizes, forward = [], engine.runner.forward
        engine.runner.forward = lambda items, aux: (sizes.append(sum(len(i.token_ids) for i in items)),
                                                    forward(items, aux))[1]
        for prompt in prompts:
            engine.add_request(prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs.append([tokens[k] for k in sorted(tokens, key=int)])
        assert max(sizes) <= 12 if budget == 12 else max(sizes[2:]) > 12, sizes   # [2:]: past the prefill
    assert outputs[0] == outputs[1]
