"""Structured output (llguidance) under every drafting method: drafts cut at the grammar, every verified row
masked by it, the output always valid, greedy speculation equal to greedy plain decoding."""
import json
import re

import httpx
import pydantic
import pytest

from specserve.config import demo_model_dir
from specserve.drafting.proposer import Draft
from specserve.drafting.tree import Tree
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.structured_output import GrammarCompiler, StructuredOutput, cut_at_grammar
from specserve.runtime.sequence import Sequence
from specserve.tokenizer import Tokenizer

from test_server import LiveServer

DEMO = demo_model_dir()
PROMPTS = ["The person:", "def fibonacci(n):", "ROMEO:"]


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")      # additionalProperties: false, as OpenAI's strict schemas
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)
    city: str = pydantic.Field(max_length=16)


FORMATS = {
    "schema": StructuredOutput(json=Person.model_json_schema()),
    "regex": StructuredOutput(regex=r"[a-z]{2,8}( [a-z]{2,8}){2,4}\."),
    "choice": StructuredOutput(choice=("def fibonacci", "class Stack", "import os")),
    "lark": StructuredOutput(grammar='start: "x = " NUMBER ("+" NUMBER)~0..2\nNUMBER: /[0-9]{1,3}/'),
}


def valid(kind: str, text: str) -> bool:
    if kind == "schema":
        Person.model_validate_json(text)
        return True
    if kind == "regex":
        return re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){2,4}\.", text) is not None
    if kind == "choice":
        return text in ("def fibonacci", "class Stack", "import os")
    return re.fullmatch(r"x = [0-9]{1,3}(\+[0-9]{1,3}){0,2}", text) is not None


def generate(llm: LLM, kind: str, **settings) -> list[str]:
    params = SamplingParams.from_dict({"max_tokens": 80, "num_assistant_tokens": 4, **settings})
    params.structured = FORMATS[kind]
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def plain():
    llm = LLM(str(DEMO), speculative_method="none")
    return {kind: generate(llm, kind, temperature=0) for kind in FORMATS}


@pytest.mark.parametrize("method,options", [("none", {}), ("ngram", {}), ("draft", {}), ("eagle3", {}), ("mtp", {}),
                                            ("eagle3", {"tree_depth": 3, "branching_factor": 2,
                                                        "num_assistant_tokens": 6})],
                         ids=["none", "ngram", "draft", "eagle3", "mtp", "eagle3-tree"])
def test_every_format_under_every_method(method, options, plain):
    llm = LLM(str(DEMO), speculative_method=method)
    for kind in FORMATS:
        texts = generate(llm, kind, temperature=0, **options)
        assert texts == plain[kind], kind
        assert all(valid(kind, t) for t in texts), (kind, texts)
        sampled = generate(llm, kind, temperature=1.0, seed=11, **options)
        assert all(valid(kind, t) for t in sampled), (kind, sampled)


def test_drafts_are_cut_at_the_grammar():
    tokenizer = Tokenizer.from_pretrained(DEMO)
    grammar = GrammarCompiler(tokenizer, 4096).matcher(StructuredOutput(choice=("import os",)))
    good, bad = tokenizer.encode("import os", add_special_tokens=False), tokenizer.encode("x", add_special_tokens=False)
    seqs = [Sequence([1, 2], SamplingParams()), Sequence([1, 2], SamplingParams())]
    seqs[0].grammar = seqs[1].grammar = grammar
    # a chain keeps its valid prefix; a tree keeps the nodes on valid paths (node 1 and its child are cut)
    tree_tokens = [good[0], bad[0], bad[0]] + good[1:2]
    parents = [-1, -1, 1, 0]
    draft = Draft([good[:1] + bad + good[1:], tree_tokens], parents=[None, parents], trees=[None, Tree(parents)])
    cut = cut_at_grammar(draft, seqs)
    assert cut.token_ids == [good[:1], [good[0], good[1]]] and cut.trees[1] is None      # what is left: a chain
    assert grammar.valid_prefix(good) == len(good)                                     # probes left no trace


@pytest.fixture(scope="module")
def server():
    with LiveServer.of_engine(model=str(DEMO), speculative_method="eagle3") as live:
        yield live


def test_openai_parse_with_a_pydantic_model(server):
    client = server.client()
    completion = client.beta.chat.completions.parse(model="m", messages=[{"role": "user", "content": "A person"}],
                                                    response_format=Person, max_tokens=80, temperature=0)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"
    schema = {"type": "json_schema", "json_schema": {"name": "Person", "schema": Person.model_json_schema()}}
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "JSON"}],
                                            response_format=schema, max_tokens=80, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert Person.model_validate_json(text)
    # any JSON object: this tiny model rambles inside strings, so only the start is sure within a few tokens
    choice = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "JSON"}],
                                            response_format={"type": "json_object"}, max_tokens=40,
                                            temperature=0).choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


def test_vllm_guided_fields(server):
    client = server.client()
    choice = client.completions.create(model="m", prompt="Pick:", max_tokens=10, temperature=0.8, seed=2,
                                       extra_body={"guided_choice": ["red", "green", "blue"]}).choices[0].text
    assert choice in ("red", "green", "blue")
    regex = client.completions.create(model="m", prompt="Date:", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"}).choices[0].text
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", regex)


@pytest.mark.parametrize("body,message", [
    ({"guided_regex": "(("}, "invalid structured output"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured output format"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_json": "{not json"}, "invalid structured output"),
])
def test_bad_formats_are_400s(server, body, message):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 4, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
