import pytest
import torch

from specserve.layers.sampler import compute_probs, draw_uniforms, sample_from_probs

from stats import assert_samples_from


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row, the obvious way, in float64."""
    logits = logits.double()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    scaled = logits / temperature
    probs = torch.softmax(scaled, dim=0)
    if 0 < top_k < logits.numel():
        kth = scaled.sort(descending=True).values[top_k - 1]
        probs = torch.where(scaled >= kth, probs, 0.0)
        probs = probs / probs.sum()
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        num_keep = int((cum < top_p).sum()) + 1  # up to and including the first prefix reaching top_p
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[:num_keep]] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


@pytest.mark.parametrize("top_ps", [(1.0, 0.9, 0.5, 0.05), (1.0,)])  # the sort path, the top-k-only path
def test_compute_probs_matches_reference(top_ps):
    torch.manual_seed(0)
    V = 50
    combos = [(t, k, p) for t in (0.0, 0.5, 1.0, 1.7) for k in (0, 1, 3, 7, V) for p in top_ps]
    logits = torch.randn(len(combos), V) * 3
    temperature = torch.tensor([c[0] for c in combos])
    top_k = torch.tensor([c[1] for c in combos])
    top_p = torch.tensor([c[2] for c in combos])
    probs = compute_probs(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float32 and probs.shape == (len(combos), V)
    for i, (t, k, p) in enumerate(combos):
        torch.testing.assert_close(probs[i].double(), reference_probs(logits[i], t, k, p), atol=1e-5, rtol=1e-4)


def test_fast_path_is_plain_softmax_and_half_logits():
    torch.manual_seed(1)
    logits = torch.randn(4, 30).bfloat16()
    temperature = torch.tensor([1.0, 0.3, 2.0, 1.0])
    probs = compute_probs(logits, temperature, torch.zeros(4, dtype=torch.long), torch.ones(4))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float() / temperature[:, None], dim=-1))


def test_greedy_rows_are_exact_one_hot_lowest_tie():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [3.0, 3.0, 0.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    probs = compute_probs(logits, torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0, 2, 2]), torch.tensor([1.0, 0.5, 1.0]))
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.equal(probs[1], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    top2 = torch.softmax(torch.tensor([2.0, 3.0]), 0)
    torch.testing.assert_close(probs[2], torch.tensor([0.0, 0.0, top2[0], top2[1]]))


def test_top_p_keeps_at_least_one_and_top_k_keeps_ties():
    logits = torch.tensor([[0.0, 4.0, 1.0, 2.0], [1.0, 2.0, 2.0, 0.0], [3.0, 1.0, 3.0, 3.0]])
    probs = compute_probs(logits, torch.ones(3), torch.tensor([0, 1, 2]), torch.tensor([1e-6, 1.0, 1.0]))
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.5, 0.5, 0.0]))  # k=1, the tie at 2.0 kept
    torch.testing.assert_close(probs[2], torch.tensor([1 / 3, 0.0, 1 / 3, 1 / 3]))
    # the same ties through the top-k-only path
    probs = compute_probs(logits[1:], torch.ones(2), torch.tensor([1, 2]), torch.ones(2))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0], [1 / 3, 0.0, 1 / 3, 1 / 3]]))


def test_sample_from_probs_distribution():
    torch.manual_seed(2)
    probs = torch.softmax(torch.randn(12), 0)
    probs[[3, 7, 11]] = 0  # zeros inside the support and at its end
    n = 60_000
    batch = probs.expand(n, -1)
    samples = sample_from_probs(batch, torch.rand(n, dtype=torch.float64))
    assert samples.dtype == torch.long and samples.shape == (n,)
    assert_samples_from(samples, probs)
    # unnormalized rows are sampled in proportion
    assert_samples_from(sample_from_probs(batch * 3.7, torch.rand(n, dtype=torch.float64)), probs)


def test_sample_from_probs_never_returns_zero_probability():
    # float32 rows summing just below 1, trailing and leading zeros, uniforms at both ends of [0, 1)
    torch.manual_seed(3)
    V = 1000
    probs = torch.rand(64, V) ** 8
    probs[:, :100] = 0
    probs[:, 900:] = 0
    probs[0, 500:] = 0
    probs[1, :] = 0
    probs[1, 5] = 1e-30
    probs = probs / probs.sum(dim=1, keepdim=True)
    last = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    for u in (torch.zeros(64, dtype=torch.float64), torch.full((64,), float(last), dtype=torch.float64),
              torch.full((64,), 1 - 1e-9, dtype=torch.float64), torch.rand(64, dtype=torch.float64)):
        tokens = sample_from_probs(probs, u)
        assert (probs.gather(1, tokens[:, None]) > 0).all()
    assert sample_from_probs(probs[1:2], torch.tensor([0.999])).item() == 5
    # u at the top lands on the last positive token
    assert sample_from_probs(probs[0:1], last[None]).item() == int(probs[0].nonzero().max())


def test_draw_uniforms_reproducible_per_seed():
    gens = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8), None]
    u = draw_uniforms(gens, 5)
    assert u.shape == (5, 5) and ((u >= 0) & (u < 1)).all()
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[3])
    assert not torch.equal(u[1], u[4])
    again = draw_uniforms([torch.Generator().manual_seed(7), None], 5)
    assert torch.equal(again[0], u[0])
    # a generator advances: its next draw differs from its first
    assert not torch.equal(draw_uniforms(gens[:1], 5)[0], u[0])
    assert draw_uniforms([], 3).shape == (0, 3)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (5, 0.7)])
def test_compute_probs_then_sample(top_k, top_p):
    # end to end: samples follow the reference distribution
    torch.manual_seed(4)
    logits = torch.randn(1, 10)
    ref = reference_probs(logits[0], 0.8, top_k, top_p)
    n = 40_000
    probs = compute_probs(logits.expand(n, -1), torch.full((n,), 0.8), torch.full((n,), top_k), torch.full((n,), top_p))
    assert_samples_from(sample_from_probs(probs, torch.rand(n, dtype=torch.float64)), ref)
