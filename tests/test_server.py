"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official openai client."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.llm_engine import LLMEngine
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.server.api_server import build_app
from conftest import make_checkpoint

NAME = "tiny"
PROMPTS = ["def fibonacci(n):", "To be, or not to be, that is", "The quick brown fox", "return fibonacci(n - 1)",
           "whether 'tis nobler in the mind", "The lazy dog", "if n < 2:", "the question: whether",
           "jumps over the lazy", "def f", "To be", "The quick brown fox jumps over the lazy dog. The",
           "nobler in", "fibonacci(n - 2)", "or not to", "suffer\nThe quick"]
ENGINE = dict(kv_cache_memory_gb=0.004, max_model_len=512, max_num_seqs=8)


class LiveServer:
    """uvicorn serving an app in a background thread, on a port bound before it starts."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        """The official OpenAI client on this server, without retries (a failure shows at once)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    @classmethod
    @contextlib.contextmanager
    def of_engine(cls, **config):
        """A live server over a fresh engine (EngineConfig fields), its AsyncEngine as .engine."""
        engine = AsyncEngine(LLMEngine(EngineConfig(**config)))
        with cls(build_app(engine, "m")) as live:
            live.engine = engine
            yield live


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("served") / "target", "qwen3")
    make_checkpoint(path / "draft", "qwen3", seed=0)     # the target's own weights: every draft token accepted
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=model_dir, **ENGINE)))
    with LiveServer(build_app(engine, NAME)) as live:
        live.engine = engine
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def offline(model_dir) -> LLM:
    return LLM(str(model_dir), **ENGINE)


def greedy(k: int, max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, num_assistant_tokens=k, **kw)


def metrics(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_idle(server, timeout: float = 10.0) -> None:
    """Until the engine holds no request and every KV block is free again."""
    engine = server.engine.engine
    deadline = time.time() + timeout
    while engine.requests or engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        assert time.time() < deadline, f"{len(engine.requests)} requests still in the engine"
        time.sleep(0.02)


def test_models_health_and_drafter(server, client, model_dir):
    assert httpx.get(f"{server.url}/health").status_code == 200
    (card,) = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert card["id"] == NAME and card["root"] == str(model_dir)
    assert [m.id for m in client.models.list()] == [NAME]
    assert server.engine.engine.spec_method == "draft"


@pytest.mark.parametrize("k", [0, 1, 5])
def test_completions_equal_offline(client, offline, k):
    expected = offline.generate(PROMPTS[:2], greedy(k))
    for prompt, ref in zip(PROMPTS[:2], expected):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"num_assistant_tokens": k})
        assert out.choices[0].text == ref.outputs[0].text
        assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
        usage = out.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.outputs[0].token_ids))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.num_draft_tokens == ref.spec["num_draft_tokens"] and usage.num_drafts == ref.spec["num_drafts"]
        assert usage.num_accepted_tokens == ref.spec["num_accepted_tokens"]
        assert usage.num_target_forwards == ref.spec["num_target_forwards"]
        assert usage.accepted_per_position == ref.spec["accepted_per_position"]
        assert (usage.num_draft_tokens == 0) == (k == 0)
        if k:
            assert usage.mean_acceptance_length > 1


@pytest.mark.parametrize("k", [0, 1, 5])
def test_chat_equals_offline(client, offline, k):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[0]}]
    ref = offline.chat(messages, greedy(k))[0]
    out = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=24, temperature=0,
                                         extra_body={"num_assistant_tokens": k})
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    parts = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
             {"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}]
    again = client.chat.completions.create(model=NAME, messages=parts, max_tokens=24, temperature=0,
                                           extra_body={"num_assistant_tokens": k})
    assert again.choices[0].message.content == ref.outputs[0].text


@pytest.mark.parametrize("k", [0, 1, 5])
def test_streams_one_chunk_per_step(client, offline, k):
    ref = offline.generate(PROMPTS[1], greedy(k))[0]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"num_assistant_tokens": k}))
    *steps, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert all(c.usage is None and len(c.choices) == 1 for c in steps)
    assert len(steps) == last.usage.num_target_forwards == ref.spec["num_target_forwards"]
    assert "".join(c.choices[0].text for c in steps) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in steps] == [None] * (len(steps) - 1) + [ref.outputs[0].finish_reason]

    messages = [{"role": "user", "content": PROMPTS[1]}]
    ref = offline.chat(messages, greedy(k))[0]
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, extra_body={"num_assistant_tokens": k}))
    assert all(len(c.choices) == 1 for c in chunks)       # no usage chunk unless asked
    role, *chunks = chunks                                # the role first, with no text, as OpenAI sends it
    assert (role.choices[0].delta.role, role.choices[0].delta.content) == ("assistant", "")
    assert all(c.choices[0].delta.role is None for c in chunks)
    assert len(chunks) == ref.spec["num_target_forwards"]
    assert "".join(c.choices[0].delta.content for c in chunks) == ref.outputs[0].text


def test_stop_strings_and_seeds(client, offline):
    text = offline.generate(PROMPTS[2], greedy(5))[0].outputs[0].text
    stop = text[6:9]
    ref = offline.generate(PROMPTS[2], greedy(5, stop=[stop]))[0].outputs[0]
    out = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == ref.text and stop not in ref.text
    assert (out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    streamed = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ref.text

    sampled = [client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=7,
                                         extra_body={"num_assistant_tokens": 3}).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_sixteen_concurrent_streams_get_their_own_output(server, offline):
    expected = [r.outputs[0].text for r in offline.generate(PROMPTS, greedy(5, max_tokens=32, ignore_eos=True))]

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        chat = i % 2 == 1
        kwargs = dict(model=NAME, max_tokens=32, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if chat:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[i]}], **kwargs)
            return "".join([c.choices[0].delta.content async for c in stream])
        stream = await client.completions.create(prompt=PROMPTS[i], **kwargs)
        return "".join([c.choices[0].text async for c in stream])

    async def run_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))

    outputs = asyncio.run(run_all())
    chat_refs = offline.chat([[{"role": "user", "content": PROMPTS[i]}] for i in range(1, 16, 2)],
                             greedy(5, max_tokens=32, ignore_eos=True))
    for i, out in enumerate(outputs):
        assert out == (chat_refs[i // 2].outputs[0].text if i % 2 else expected[i]), f"client {i}"
    wait_idle(server)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, monkeypatch):
    wait_idle(server)
    # each step slowed to a few ms, so that the requests are still running when their clients leave
    engine, step = server.engine.engine, server.engine.engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.003), step())[1])
    before = metrics(server)
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True, "stream": True,
            "num_assistant_tokens": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        assert server.engine.engine.block_manager.num_free_blocks < server.engine.engine.block_manager.num_blocks
    wait_idle(server)
    # non-streaming: the client gives up waiting
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=0.3,
                   json={**body, "stream": False, "num_assistant_tokens": 0})
    wait_idle(server)
    after = metrics(server)
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    assert after[key] - before.get(key, 0) == 2
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_grow_by_reported_statistics(server, client):
    wait_idle(server)
    before = metrics(server)
    usages = [client.completions.create(model=NAME, prompt=p, max_tokens=20, temperature=0,
                                        extra_body={"num_assistant_tokens": k}).usage
              for p, k in zip(PROMPTS[:3], (0, 2, 5))]
    usages.append(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[4]}],
                                                 max_tokens=20, temperature=0.8, seed=1).usage)
    usages.append(list(client.completions.create(model=NAME, prompt=PROMPTS[5], max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))[-1].usage)
    after = metrics(server)

    def grew(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert grew("vllm:spec_decode_num_drafts_total") == sum(u.num_drafts for u in usages)
    assert grew("vllm:spec_decode_num_draft_tokens_total") == sum(u.num_draft_tokens for u in usages)
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == sum(u.num_accepted_tokens for u in usages)
    assert sum(u.num_draft_tokens for u in usages) > 0
    for pos in range(5):
        reported = sum(u.accepted_per_position[pos] for u in usages if len(u.accepted_per_position) > pos)
        assert grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(pos)),)) == reported
    assert grew("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("vllm:request_success_total", (("finished_reason", "length"),)) + grew(
        "vllm:request_success_total", (("finished_reason", "stop"),)) == len(usages)
    assert grew("vllm:time_to_first_token_seconds_count") == len(usages)
    assert grew("vllm:time_per_output_token_seconds_count") == len(usages)
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= {
        name for name, _ in after}
    # the draft-length gauges: the last request (default "auto") drafted, the chosen lengths are in its usage
    assert usages[1].draft_lengths[:4] == [2] * 4 and set(usages[0].draft_lengths) == {0}
    assert all(u.draft_lengths and max(u.draft_lengths) <= 8 for u in usages)
    mean, fraction = after[("specserve:spec_decode_mean_draft_length", ())], \
        after[("specserve:spec_decode_drafting_fraction", ())]
    assert 0 < mean <= 8 and 0 < fraction <= 1


def test_non_streaming_reports_tokens_per_second(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8})
    assert response.status_code == 200 and float(response.headers["x-tokens-per-second"]) > 0


def test_tokenize_and_detokenize(server, offline):
    ids = offline.tokenizer.encode(PROMPTS[0])
    got = httpx.post(f"{server.url}/tokenize", json={"model": NAME, "prompt": PROMPTS[0]}).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 512
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == offline.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                                      add_special_tokens=False)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPTS[0]}


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    ("malformed json", COMPLETIONS, b'{"prompt": "a", ', 400, None),
    ("body not an object", COMPLETIONS, b'[1, 2]', 400, None),
    ("max_tokens not an int", COMPLETIONS, {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("messages not a list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages"),
    ("missing prompt", COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
    ("unknown model", COMPLETIONS, {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("max_tokens 0", COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_completion_tokens 0", CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("negative temperature", CHAT, {"messages": MESSAGES, "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", COMPLETIONS, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("negative num_assistant_tokens", COMPLETIONS, {"prompt": "a", "num_assistant_tokens": -1}, 400,
     "num_assistant_tokens"),
    ("num_assistant_tokens over the maximum", CHAT, {"messages": MESSAGES, "num_assistant_tokens": 33}, 400,
     "num_assistant_tokens"),
    ("prompt_lookup_min below 1", COMPLETIONS, {"prompt": "a", "prompt_lookup_min": 0}, 400, "prompt_lookup_min"),
    ("max_ngram_size not an integer", COMPLETIONS, {"prompt": "a", "max_ngram_size": 2.5}, 400, "max_ngram_size"),
    ("tree without a tree drafter", CHAT, {"messages": MESSAGES, "tree_depth": 2}, 400, None),
    ("prompt longer than the context", COMPLETIONS, {"prompt": [5] * 600, "max_tokens": 1}, 400, "max_tokens"),
    ("prompt longer than the context, no max_tokens", COMPLETIONS, {"prompt": [5] * 600}, 400, None),
    ("prompt + max_tokens over the context", COMPLETIONS, {"prompt": "a", "max_tokens": 600}, 400, "max_tokens"),
    ("token id out of the vocabulary", COMPLETIONS, {"prompt": [1, 100000]}, 400, None),
    ("n over 16", COMPLETIONS, {"prompt": "a", "n": 17}, 400, "n"),
    ("top_logprobs over 20", CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("best_of", COMPLETIONS, {"prompt": "a", "best_of": 2}, 400, "best_of"),
    ("several prompts", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt"),
    ("stream not a bool", COMPLETIONS, {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("unknown route", "/v1/embeddings", {"input": "a"}, 404, None),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_openai_error(server, case):
    _, path, body, status, param = case
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server.url}{path}", **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError, match="tree"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, extra_body={"tree_depth": 1})


def test_full_server_answers_503(server):
    engine = server.engine
    limit, engine.max_num_in_flight = engine.max_num_in_flight, 0
    try:
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
    finally:
        engine.max_num_in_flight = limit
    assert response.status_code == 503 and "capacity" in response.json()["error"]["message"]
    assert response.headers["retry-after"] == "1"
