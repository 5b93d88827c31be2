"""Issue 12: fuzzing the live server with hypothesis, from its own OpenAPI schema. Each generated body mixes
values of the schema's types (within and past its bounds) with hostile ones (huge integers, integral and
non-finite floats, lone surrogates, wrong types, deep nesting, unknown keys). No case may get a 5xx or an
error event in a stream, every 4xx is OpenAI's error JSON, and /health answers 200 after every case.
Bounded: a fixed number of examples, and a wall-clock budget after which the remaining ones are skipped."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.config import EngineConfig, demo_model_dir
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.llm_engine import LLMEngine
from specserve.server.api_server import build_app
from test_server import LiveServer

DEMO = demo_model_dir()
ENGINE = dict(model=DEMO, speculative_method="eagle3", draft_model=DEMO / "eagle3", kv_cache_memory_gb=0.02,
              max_model_len=192, max_num_seqs=8)
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
BUDGET_S = 25.0                # for all the cases together (the suite must stay well under 15 minutes)
SMALL_COUNTS = ("max_tokens", "max_completion_tokens")     # kept small when valid, so that cases stay quick

HOSTILE = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([0, -1, 1 << 63, (1 << 64) - 1, 1 << 64, 10 ** 30, 2049, 5000]),
    st.floats(allow_nan=False), st.sampled_from([5.0, 2.0001, 1e300, -0.0, 1e-300, float("inf")]),
    st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", "\ud83d\ude00", "", "\x00", "Bearer"]),
    st.lists(st.integers(-5, 5000), max_size=6), st.lists(st.text(max_size=4), max_size=20),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    st.recursive(st.integers(), lambda inner: st.lists(inner, max_size=2), max_leaves=40),
)


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine(LLMEngine(EngineConfig(**ENGINE)))
    app = build_app(engine, "demo", max_request_bytes=1 << 16)
    schema = app.openapi()
    with LiveServer(app) as live:
        live.engine, live.schema = engine, schema
        live.http = httpx.Client(base_url=live.url, timeout=60)
        yield live
        live.http.close()


def resolve(schema: dict, spec: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def typed(schema: dict, spec: dict, name: str = "", depth: int = 0) -> st.SearchStrategy:
    """Values of a JSON schema's type: inside its bounds, at them, and just past them."""
    schema = resolve(schema, spec)
    if "anyOf" in schema:
        return st.one_of([typed(s, spec, name, depth) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "integer":
        if name in SMALL_COUNTS:
            return st.integers(-1, 12)
        low, high = schema.get("minimum"), schema.get("maximum")
        edges = [v for v in (low, high, -1, 0, 1, 2) if v is not None]
        edges += [low - 1] if low is not None else []
        edges += [high + 1] if high is not None else []
        wide = st.integers(-(1 << 65) if low is None else low, (1 << 65) if high is None else high)
        return st.one_of(st.integers(-3, 40), st.integers(0, 8), st.sampled_from(edges), wide)
    if kind == "number":
        low, high = schema.get("minimum", -2.0), schema.get("maximum", 2.0)
        return st.one_of(st.floats(low, high), st.sampled_from([low, high, low - 1e-3, high + 1e-3, 1.0, 0.5]))
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.one_of(st.text(max_size=24), st.sampled_from(["def f", "The quick", "\n", "text"]))
    if kind == "array":
        items = typed(schema.get("items", {}), spec, name, depth + 1) if depth < 3 else st.integers(0, 10)
        return st.lists(items, max_size=4)
    if kind == "object" or "properties" in schema:
        return mutated(schema, spec, {}, depth + 1) if depth < 3 else st.just({})
    if kind == "null":
        return st.none()
    return HOSTILE


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.one_of(st.text(max_size=30), st.just([{"type": "text", "text": "hi"}]))})
BASES = {
    "/v1/completions": st.fixed_dictionaries({"prompt": st.one_of(
        st.sampled_from(["def fibonacci(n):", "To be, or not to be", "The quick brown fox"]),
        st.lists(st.integers(3, 4000), min_size=1, max_size=8))}),
    "/v1/chat/completions": st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=3)}),
    "/tokenize": st.one_of(st.fixed_dictionaries({"prompt": st.text(max_size=40)}),
                           st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=2)})),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 4095), max_size=8)}),
}


def mutated(schema: dict, spec: dict, base: dict, depth: int = 0) -> st.SearchStrategy:
    """base with some of the schema's properties set: most to values of their type, a few to hostile
    values, sometimes an unknown key too."""
    props = resolve(schema, spec).get("properties", {})

    @st.composite
    def build(draw):
        body = dict(base)
        names = draw(st.lists(st.sampled_from(sorted(props)), max_size=6, unique=True)) if props else []
        for name in names:
            hostile = draw(st.integers(0, 7)) == 0
            body[name] = draw(HOSTILE if hostile else typed(props[name], spec, name, depth))
        if draw(st.integers(0, 7)) == 0:
            body[draw(st.text(max_size=8))] = draw(HOSTILE)
        return body

    return build()


@st.composite
def case(draw, spec: dict):
    path = draw(st.sampled_from(PATHS))
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    base = draw(BASES[path])
    if "/v1/" in path:                    # what most real requests set: a temperature, often a seed
        props = resolve(schema, spec)["properties"]
        for name, share in (("temperature", 2), ("seed", 3), ("stream", 4)):
            if draw(st.integers(0, share - 1)) == 0:
                base[name] = draw(typed(props[name], spec, name))
    body = draw(mutated(schema, spec, base))
    if draw(st.integers(0, 2)) > 0:
        body.pop("model", None)           # a random model name is a 404 and reaches nothing further
    if "/v1/" in path and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = draw(st.integers(1, 8))
    return path, body


def check_case(server, path: str, body: dict) -> int:
    payload = json.dumps(body)                     # ASCII: lone surrogates travel as \ud800 escapes
    if body.get("stream") is True:
        with server.http.stream("POST", path, content=payload, headers={"content-type": "application/json"}) as r:
            lines = list(r.iter_lines())
            status = r.status_code
            text = "\n".join(lines)
        assert status < 500, (path, body, text)
        if status == 200:
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]", (path, body, text)
            assert not any('"error"' in e and e.startswith('{"error"') for e in events), (path, body, text)
        else:
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    else:
        status = None
        response = server.http.post(path, content=payload, headers={"content-type": "application/json"})
        status = response.status_code
        assert status < 500, (path, body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
    health = server.http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}, (path, body, health.text)
    return status


def test_fuzzed_requests_never_get_a_5xx(server):
    spec, deadline = server.schema, time.monotonic() + BUDGET_S
    counts = {"run": 0, "skipped": 0}
    statuses: dict[int, int] = {}

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case(spec))
    def run(generated):
        if time.monotonic() > deadline:
            counts["skipped"] += 1
            return
        counts["run"] += 1
        status = check_case(server, *generated)
        statuses[status] = statuses.get(status, 0) + 1

    run()
    engine = server.engine.engine
    wait_until = time.time() + 10
    while engine.requests or engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        assert time.time() < wait_until, "requests left in the engine after the fuzzing"
        time.sleep(0.05)
    print(f"\nfuzz: {counts['run']} cases run (statuses {dict(sorted(statuses.items()))}), "
          f"{counts['skipped']} past the {BUDGET_S:.0f} s budget skipped")
    assert counts["run"] >= 50 and statuses.get(200, 0) >= 10      # the bodies reach the engine, not only the validator


def test_fuzzed_raw_bodies_never_get_a_5xx(server):
    """Bytes that are not JSON objects: truncated, invalid UTF-8, deep, huge numbers, over the size limit."""
    seeds = [b'{"prompt": "a", "max_tokens": 2}', b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}']
    deadline = time.monotonic() + 10

    @settings(max_examples=120, deadline=None, database=None, derandomize=True)
    @given(st.sampled_from(PATHS), st.sampled_from(seeds), st.integers(0, 60), st.binary(max_size=16),
           st.sampled_from([b"", b"[" * 3000, b"\xff", b"9" * 5000, b"\\ud800", b"x" * 70000]))
    def run(path, seed, cut, noise, tail):
        if time.monotonic() > deadline:
            return
        body = seed[:cut] + noise + tail
        response = server.http.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code < 500, (path, body[:200], response.text)
        assert set(response.json()) <= {"error", "id", "object", "created", "model", "choices", "usage",
                                        "count", "max_model_len", "tokens", "prompt"}
        assert server.http.get("/health").status_code == 200

    run()
