"""n > 1: one sequence per choice, choice i seeded seed + i, the prompt's KV blocks computed once and shared through
the prefix cache; each choice drafted and verified on its own."""
import httpx
import pytest

from specserve.config import demo_model_dir
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

from test_server import LiveServer

DEMO = demo_model_dir()
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def run_alone(ids: list[int], params: SamplingParams, cached: bool) -> list[int]:
    """The request by itself on a fresh engine, its prompt's full blocks first cached (as a sibling finds them)."""
    llm = LLM(str(DEMO), speculative_method="ngram", block_size=4)
    if cached:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    return llm.generate([ids], [params])[0].outputs[0].token_ids


def test_siblings_wait_for_the_prompt_and_share_its_blocks():
    llm = LLM(str(DEMO), speculative_method="ngram", block_size=4)
    engine, ids = llm.engine, llm.tokenizer.encode(PROMPT)
    params = [SamplingParams(temperature=0.8, seed=10 + i, max_tokens=12, ignore_eos=True) for i in range(3)]
    first = engine.add_request(ids, params[0], "r-0")
    siblings = [engine.add_request(ids, p, f"r-{i + 1}", after="r-0") for i, p in enumerate(params[1:])]
    assert engine.parked == {"r-0": siblings} and len(engine.scheduler.waiting) == 1
    while engine.has_unfinished():
        engine.step()
    full = len(ids) // 4 * 4
    assert all(s.num_cached_tokens == full for s in siblings) and first.num_cached_tokens == 0
    # each choice is its request alone, with its own seed (a prefix-cache hit recomputes the prompt's last rows in
    # a shorter chunk, so the reference hits the cache the same way)
    for seq, p in zip([first, *siblings], params):
        assert seq.output_token_ids == run_alone(ids, p, cached=seq is not first)


def test_an_aborted_parent_lets_its_siblings_run():
    llm = LLM(str(DEMO), speculative_method="ngram")
    engine, ids = llm.engine, llm.tokenizer.encode(PROMPT)
    engine.add_request(ids, SamplingParams(max_tokens=4), "p")
    sibling = engine.add_request(ids, SamplingParams(max_tokens=4), "s", after="p")
    engine.abort("p")
    while engine.has_unfinished():
        engine.step()
    assert sibling.num_output_tokens == 4 and not engine.parked


@pytest.fixture(scope="module")
def server():
    # n-gram drafts are deterministic, so a seeded choice is exactly the same request sent alone (a sampling
    # drafter's q, and so which tokens it proposes, may differ in the last bits with the batch beside it)
    with LiveServer.of_engine(model=str(DEMO), speculative_method="ngram") as live:
        yield live


def test_n_choices_are_seeded_seed_plus_i(server):
    client = server.client()
    body = dict(model="m", prompt=PROMPT, max_tokens=10, temperature=0.9, extra_body={"ignore_eos": True})
    many = client.completions.create(**body, n=3, seed=40)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.text for c in many.choices}) == 3      # which seed each takes: the engine-level test above
    assert many.usage.completion_tokens == 30 and many.usage.prompt_tokens == len(
        httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    assert len(many.usage.draft_lengths) == 27          # every choice drafted by itself: 9 decode steps each


def test_n_choices_stream_with_their_index(server):
    client = server.client()
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Count"}], max_tokens=8, temperature=0.7, seed=1, n=2,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    for c in chunks:
        if c.choices:
            texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert roles == [0, 1] and chunks[-1].usage.completion_tokens == 16
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count"}], max_tokens=8,
                                           temperature=0.7, seed=1, n=2, extra_body={"ignore_eos": True})
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    engine = server.engine.engine
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_n_out_of_range_is_a_400(server):
    for n in (0, 17):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "a", "n": n})
        assert r.status_code == 400 and "n" in r.json()["error"]["param"], r.text
