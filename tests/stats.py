"""Statistical helpers shared by the exactness tests."""
from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare


def assert_samples_from(samples: torch.Tensor, probs: torch.Tensor, min_pvalue: float = 1e-3,
                        lump_below: float = 0.0) -> None:
    """Chi-square goodness of fit of integer samples against probs [V]; zero-probability tokens never occur.
    Bins expecting fewer than lump_below draws are pooled into one, which keeps the test valid."""
    samples = torch.as_tensor(np.asarray(samples))
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a zero-probability token"
    expected = probs.double() / probs.double().sum() * counts.sum()
    big = support & (expected >= lump_below)
    small = support & ~big
    observed = torch.cat([counts[big], counts[small].sum()[None]]) if small.any() else counts[big]
    wanted = torch.cat([expected[big], expected[small].sum()[None]]) if small.any() else expected[big]
    assert chisquare(observed.numpy(), wanted.numpy()).pvalue > min_pvalue


def second_token_marginal(model, prompt: list[int]) -> torch.Tensor:
    """The exact distribution of the second token sampled at temperature 1 after prompt:
    sum over t1 of p(t1 | prompt) p(t2 | prompt, t1), from one batched forward over every t1."""
    from specserve.runtime.model_runner import ForwardItem, ModelRunner
    c = model.config
    V, n = c.vocab_size, len(prompt)
    runner = ModelRunner(model, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, V + 1, n + 2, torch.float32)
    with torch.no_grad():
        h, _ = runner.forward([ForwardItem([0], 0, prompt)])
        p1 = torch.softmax(model.compute_logits(h[-1:]).double(), -1)[0]
        h, _ = runner.forward([ForwardItem([t + 1], 0, prompt + [t]) for t in range(V)])
        p2 = torch.softmax(model.compute_logits(h[torch.arange(1, V + 1) * (n + 1) - 1]).double(), -1)
    return (p1[:, None] * p2).sum(0)


def assert_second_token_is_the_targets(llm, n: int, num_assistant_tokens=3, text: str = "The quick brown") -> None:
    """n unseeded-alike requests (seeds 0..n-1) at temperature 1 drafting `num_assistant_tokens`: drafts are both
    accepted and rejected, and the second output token, produced by verification, follows the target's marginal."""
    from specserve.sampling_params import SamplingParams
    prompt = llm.tokenizer.encode(text)
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i,
                                                      num_assistant_tokens=num_assistant_tokens) for i in range(n)])
    accepted = sum(o.spec["num_accepted_tokens"] for o in outs)
    assert 0 < accepted < sum(o.spec["num_draft_tokens"] for o in outs)
    assert_samples_from([o.outputs[0].token_ids[1] for o in outs], second_token_marginal(llm.engine.model, prompt),
                        lump_below=5)
