"""Penalties and biases (presence, frequency, repetition, min_tokens, min_p, logit_bias) under every drafting
method: applied to p at every verified row with the tokens before it, so greedy speculation equals greedy plain
decoding and sampled output keeps plain decoding's distribution."""
import httpx
import pytest
import torch

from specserve.config import demo_model_dir
from specserve.layers.logits_processors import process_rows
from specserve.layers.sampler import compute_probs
from specserve.llm import LLM
from specserve.runtime.model_runner import ForwardItem, ModelRunner
from specserve.sampling_params import SamplingParams

from stats import assert_samples_from
from test_server import LiveServer
from test_spec import damped_pair  # noqa: F401  (fixture)

DEMO = demo_model_dir()
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "The capital of France is"]
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1, logit_bias={7: 1.5},
                 min_tokens=20, min_p=0.05)


def test_the_arithmetic_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={3: 1.0}, min_tokens=3)
    # prompt [2]; output [0, 0]; then draft token [1] before this row; EOS = 4 masked (3 tokens < min_tokens? no:
    # output 2 + draft 1 = 3, not below 3); a second row without the draft token: 2 < 3, masked
    out = process_rows(logits.repeat(2, 1), params, prompt=[2], output=[0, 0], prefixes=[[1], []], stop_ids={4})
    # token 0: 2/2 - 0.5*2 - 0.25 = -0.25; token 1 (draft): -1*2 - 0.5 - 0.25 = -2.75; token 2 (prompt): 0.25
    assert out[0].tolist() == pytest.approx([-0.25, -2.75, 0.25, 2.0, 3.0])
    assert out[1].tolist() == pytest.approx([-0.25, -1.0, 0.25, 2.0, float("-inf")])
    probs = compute_probs(torch.tensor([[0.0, -10.0, 1.0]]), torch.tensor([1.0]), torch.tensor([0]),
                          torch.tensor([1.0]), torch.tensor([0.3]))
    assert probs[0, 1] == 0 and probs[0].sum() == pytest.approx(1.0)        # min_p drops the unlikely token


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(str(DEMO), speculative_method="none")


@pytest.fixture(scope="module")
def plain(plain_llm):
    llm = plain_llm
    return {mode: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(
        max_tokens=32, num_assistant_tokens=4, **settings, **PENALTIES))]
        for mode, settings in (("greedy", dict(temperature=0)), ("sampled", dict(temperature=0.9, seed=3)))}


@pytest.mark.parametrize("method,options", [("ngram", {}), ("draft", {}), ("eagle3", {}), ("mtp", {}),
                                            ("eagle3", {"tree_depth": 3, "branching_factor": 2})],
                         ids=["ngram", "draft", "eagle3", "mtp", "eagle3-tree"])
def test_greedy_with_penalties_equals_plain(method, options, plain):
    llm = LLM(str(DEMO), speculative_method=method)
    params = SamplingParams(temperature=0, max_tokens=32, num_assistant_tokens=6 if options else 4, **PENALTIES,
                            draft_options=options)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == plain["greedy"]
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 0
    if method in ("ngram", "eagle3"):      # deterministic drafts: seeded sampling is plain sampling, token for token
        sampled = llm.generate(PROMPTS, SamplingParams(temperature=0.9, seed=3, max_tokens=32, num_assistant_tokens=4,
                                                       **PENALTIES, draft_options=options))
        assert [o.outputs[0].token_ids for o in sampled] == plain["sampled"]


def test_penalties_change_the_output(plain, plain_llm):
    free = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32))]
    assert free != plain["greedy"]


def penalized_second_token_marginal(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """sum over t1 of p(t1 | prompt) p(t2 | prompt, t1), each with the penalties of its position."""
    c = model.config
    V, n = c.vocab_size, len(prompt)
    runner = ModelRunner(model, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, V + 1, n + 2, torch.float32)
    with torch.no_grad():
        h, _ = runner.forward([ForwardItem([0], 0, prompt)])
        l1 = process_rows(model.compute_logits(h[-1:]), params, prompt, [], [[]], set())
        p1 = torch.softmax(l1.double(), -1)[0]
        h, _ = runner.forward([ForwardItem([t + 1], 0, prompt + [t]) for t in range(V)])
        l2 = model.compute_logits(h[torch.arange(1, V + 1) * (n + 1) - 1])
        l2 = torch.cat([process_rows(l2[t:t + 1], params, prompt, [t], [[]], set()) for t in range(V)])
        p2 = torch.softmax(l2.double(), -1)
    return (p1[:, None] * p2).sum(0)


def test_sampled_with_penalties_has_the_target_distribution(damped_pair):
    """Token 2 comes from verifying the draft model's sampled token, both with penalties: its marginal is plain
    decoding's with the same penalties."""
    llm = LLM(str(damped_pair), kv_cache_memory_gb=0.05, speculative_method="draft", max_num_seqs=256)
    prompt = llm.tokenizer.encode("The quick brown")
    settings = dict(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.5, logit_bias={5: 2.0})
    n = 3000
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i,
                                                      num_assistant_tokens=3, **settings) for i in range(n)])
    assert 0 < sum(o.spec["num_accepted_tokens"] for o in outs) < sum(o.spec["num_draft_tokens"] for o in outs)
    second = [o.outputs[0].token_ids[1] for o in outs]
    reference = penalized_second_token_marginal(llm.engine.model, prompt, SamplingParams(**settings))
    assert_samples_from(second, reference, lump_below=5)


def test_server_takes_the_fields_and_checks_them():
    with LiveServer.of_engine(model=str(DEMO), speculative_method="ngram") as live:
        url = f"{live.url}/v1/completions"
        body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        ok = httpx.post(url, json={**body, "presence_penalty": 1.0, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
                                   "min_tokens": 4, "min_p": 0.1, "logit_bias": {"7": 5}})
        assert ok.status_code == 200, ok.text
        for bad, param in (({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                           ({"logit_bias": {"7": 101}}, "logit_bias"), ({"repetition_penalty": 0}, "repetition_penalty"),
                           ({"logit_bias": {"999999": 1}}, "logit_bias")):
            r = httpx.post(url, json={**body, **bad})
            assert r.status_code == 400 and param in r.text, r.text
