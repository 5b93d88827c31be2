"""logprobs / top_logprobs: the target's raw log-probabilities of the emitted tokens, the same under every
drafting method as in plain decoding, in OpenAI's chat and completions shapes."""
import httpx
import pytest
import torch

from specserve.config import default_model_dir, demo_model_dir
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.server.token_text import TokenText
from specserve.tokenizer import Tokenizer

from test_server import LiveServer

DEMO = demo_model_dir()
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "The capital of France is"]
METHODS = [("ngram", {}), ("draft", {}), ("eagle3", {}), ("mtp", {}),
           ("eagle3", {"tree_depth": 3, "branching_factor": 2, "num_assistant_tokens": 6})]


def run(llm: LLM, **settings) -> list:
    engine = llm.engine
    seqs = [engine.add_request(llm.tokenizer.encode(p), SamplingParams.from_dict(
        {"max_tokens": 24, "ignore_eos": True, "logprobs": 3, "num_assistant_tokens": 4, **settings}))
        for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    return seqs


@pytest.fixture(scope="module")
def plain():
    llm = LLM(str(DEMO), speculative_method="none", dtype="float32")
    return {"greedy": run(llm, temperature=0), "sampled": run(llm, temperature=0.8, seed=7)}


def teacher_forced(llm: LLM, seq) -> torch.Tensor:
    """The target's logprobs of seq's output tokens, from one forward over the prompt and the output."""
    model, ids = llm.engine.model, seq.token_ids
    with torch.inference_mode():
        hidden, _ = model(torch.tensor([ids]), torch.arange(len(ids)), None)
        logp = torch.log_softmax(model.compute_logits(hidden[0]).float(), dim=-1)
    n = seq.num_prompt_tokens
    return logp[n - 1:len(ids) - 1].gather(1, torch.tensor(ids[n:])[:, None]).view(-1)


def assert_same(got_seq, want_seq):
    assert got_seq.output_token_ids == want_seq.output_token_ids
    for got, want in zip(got_seq.logprobs, want_seq.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top] and len(got.top) == 3
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-5)


@pytest.mark.parametrize("method,options", METHODS, ids=["ngram", "draft", "eagle3", "mtp", "eagle3-tree"])
def test_logprobs_equal_plain_decodings_under_every_method(method, options, plain):
    """Greedy: the same tokens and logprobs as plain decoding. Sampled: drafters that sample (draft model, MTP)
    take other, equally distributed paths, so each token's logprob is checked against the target run over the
    same text; deterministic drafts (n-gram, EAGLE3) give plain sampling's very tokens."""
    llm = LLM(str(DEMO), speculative_method=method, dtype="float32")   # fp32: the teacher-forced check
    greedy = run(llm, temperature=0, **options)
    assert sum(s.spec.num_accepted_tokens for s in greedy) > 0
    for seq, ref in zip(greedy, plain["greedy"]):
        assert len(seq.logprobs) == len(seq.output_token_ids) == 24
        assert [lp.token_id for lp in seq.logprobs] == seq.output_token_ids
        assert_same(seq, ref)
        assert all(lp.top[0][1] >= lp.logprob - 1e-6 for lp in seq.logprobs)   # raw: nothing above the top one
    sampled = run(llm, temperature=0.8, seed=7, **options)
    for seq, ref in zip(sampled, plain["sampled"]):
        if method in ("draft", "mtp"):
            got = torch.tensor([lp.logprob for lp in seq.logprobs])
            torch.testing.assert_close(got, teacher_forced(llm, seq), atol=1e-4, rtol=0)
        else:
            assert_same(seq, ref)


def test_logprobs_stop_with_the_text():
    llm = LLM(str(DEMO), speculative_method="ngram")
    out = llm.engine.add_request(llm.tokenizer.encode(PROMPTS[0]), SamplingParams(
        temperature=0, max_tokens=40, logprobs=0, num_assistant_tokens=5, stop=["\n"]))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert len(out.logprobs) == len(out.output_token_ids) and all(lp.top == () for lp in out.logprobs)


def test_token_bytes_of_a_byte_level_tokenizer():
    text_of = TokenText(Tokenizer.from_pretrained(default_model_dir()))
    ids = text_of.tokenizer.encode("日本語 naïve", add_special_tokens=False)
    assert b"".join(bytes(text_of.of(t)[1]) for t in ids) == "日本語 naïve".encode()


@pytest.fixture(scope="module")
def server():
    with LiveServer.of_engine(model=str(DEMO), speculative_method="eagle3") as live:
        yield live


def test_chat_logprobs_streamed_and_whole(server):
    client = server.client()
    body = dict(model="m", messages=[{"role": "user", "content": "Write a loop"}], max_tokens=12, temperature=0,
                logprobs=True, top_logprobs=2, extra_body={"num_assistant_tokens": 4})
    whole = client.chat.completions.create(**body).choices[0]
    content = whole.logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == whole.message.content
    streamed = [t for chunk in client.chat.completions.create(**body, stream=True) if chunk.choices
                and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in content]
    plain = client.chat.completions.create(**{**body, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_and_offsets(server):
    client = server.client()
    choice = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=10, temperature=0, logprobs=3).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    assert all(len(top) <= 3 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=10, temperature=0, logprobs=3,
                                            stream=True))
    offsets = [o for c in chunks if c.choices for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


@pytest.mark.parametrize("body,message", [
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_bad_logprobs_requests_are_400s(server, body, message):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(f"{server.url}{path}", json={"model": "m", "max_tokens": 2, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_prompt_logprobs_are_the_targets_and_skip_the_prefix_cache(method):
    llm = LLM(str(DEMO), speculative_method=method, dtype="float32", max_num_batched_tokens=8)   # chunked prompts
    engine, ids = llm.engine, llm.tokenizer.encode(PROMPTS[1])
    for _ in range(2):                         # the second time the blocks are cached: not used for this request
        seq = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
        while engine.has_unfinished():
            engine.step()
        assert seq.num_cached_tokens == 0
        assert [lp.token_id for lp in seq.prompt_logprobs] == ids[1:] and all(len(lp.top) == 2 for lp in seq.prompt_logprobs)
        with torch.inference_mode():
            hidden, _ = engine.model(torch.tensor([ids]), torch.arange(len(ids)), None)
            logp = torch.log_softmax(engine.model.compute_logits(hidden[0]).float(), dim=-1)
        want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).view(-1)
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in seq.prompt_logprobs]), want, atol=1e-4, rtol=0)


def test_echo_leads_with_the_prompt_and_its_logprobs(server):
    client = server.client()
    body = dict(model="m", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True, logprobs=2)
    choice = client.completions.create(**body).choices[0]
    plain = client.completions.create(**{**body, "echo": False}).choices[0]
    assert choice.text == PROMPTS[0] + plain.text
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text and lp.tokens[-6:] == plain.logprobs.tokens
    streamed = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert [o for c in streamed if c.choices for o in c.choices[0].logprobs.text_offset] == lp.text_offset
