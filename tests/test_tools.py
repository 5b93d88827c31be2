"""Tool calls (Hermes convention): tools offered in the prompt, <tool_call> blocks parsed into OpenAI's tool_calls,
"required" and named choices enforced by grammar, streamed as tool-call deltas; the same under speculation."""
import json

import httpx
import pytest

from specserve.config import demo_model_dir
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.server.tools import call_grammar, parse_calls, render_messages, safe_prefix

from test_server import LiveServer

DEMO = demo_model_dir()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_hermes_rendering_and_parsing():
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    rendered = render_messages(history, [WEATHER], template_has_tools=False)
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert render_messages(ASK, [WEATHER], template_has_tools=True) == ASK
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n{"na'
    content, calls = parse_calls(text)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    assert parse_calls("no calls") == ("no calls", [])
    assert [safe_prefix(t) for t in ("ab <tool", "ab", "a<tool_call>{")] == [3, 2, 1]


@pytest.mark.parametrize("method", ["ngram", "eagle3", "draft"])
def test_forced_calls_follow_the_grammar_and_equal_plain_decoding(method):
    params = SamplingParams(temperature=0, max_tokens=80, num_assistant_tokens=4, structured=call_grammar([WEATHER, TIME]))
    prompt = render_messages(ASK, [WEATHER, TIME], template_has_tools=False)
    plain = LLM(str(DEMO), speculative_method="none").chat(prompt, params)[0].outputs[0].text
    spec = LLM(str(DEMO), speculative_method=method).chat(prompt, params)[0].outputs[0].text
    assert spec == plain
    content, calls = parse_calls(plain)
    assert calls and content is None
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        assert (call["function"]["name"], set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))


@pytest.fixture(scope="module")
def client():
    with LiveServer.of_engine(model=str(DEMO), speculative_method="eagle3") as live:
        yield live.client(), live.url


def test_tool_call_round_trip_with_the_openai_sdk(client):
    sdk, _ = client
    first = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                        max_tokens=60, temperature=0).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    call = first.message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    history = ASK + [first.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = sdk.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_named_choice_streams_tool_call_deltas(client):
    sdk, _ = client
    named = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                              max_tokens=60, temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and all(d.function.name == "get_time" for d in deltas)
    assert json.loads(deltas[0].function.arguments)["zone"] in ("UTC", "CET")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)    # the call is not content


@pytest.mark.parametrize("body,message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response format"),
])
def test_bad_tool_requests_are_400s(client, body, message):
    _, url = client
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
