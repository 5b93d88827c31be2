import pytest
import torch

from specserve.layers.sampler import compute_probs, sample_from_probs
from specserve.drafting.verify import verify_greedy, verify_rejection

from stats import assert_samples_from

V = 8
N = 50_000  # draws per statistical test, vectorised as one batch


def t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


# ---- greedy ----------------------------------------------------------------------------------

def test_verify_greedy_hand_cases():
    target = t([[1, 2, 3, 4],    # all accepted + bonus 4
                [1, 2, 3, 4],    # first rejected: the target's 1
                [1, 2, 3, 4],    # mismatch in the middle
                [1, 2, 3, 4],    # num_draft 0: just the target's token
                [1, 2, 3, 4],    # num_draft 2, both accepted: bonus is target[2]
                [5, 6, 7, 8]])   # num_draft 1, padding -1 ignored
    draft = t([[1, 2, 3], [9, 2, 3], [1, 9, 3], [1, 2, 3], [1, 2, 9], [5, -1, -1]])
    num_draft = torch.tensor([3, 3, 3, 0, 2, 1])
    tokens, num_tokens = verify_greedy(target, draft, num_draft)
    assert num_tokens.tolist() == [4, 1, 2, 1, 3, 2]
    assert tokens.tolist() == [[1, 2, 3, 4], [1, -1, -1, -1], [1, 2, -1, -1],
                               [1, -1, -1, -1], [1, 2, 3, -1], [5, 6, -1, -1]]


def test_verify_greedy_no_draft_positions():
    tokens, num_tokens = verify_greedy(t([[3], [4]]), torch.empty(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert tokens.tolist() == [[3], [4]] and num_tokens.tolist() == [1, 1]


# ---- rejection sampling: statistical exactness ------------------------------------------------

def random_dist(n: int, gen: torch.Generator, scale: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(n, V, generator=gen) * scale, dim=-1)


def make_case(case: str, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (p [K+1, V], q [K, V] or None) for one scenario."""
    p, q = random_dist(K + 1, gen), random_dist(K, gen)
    if case == "q_zero_where_p_positive":
        q[:, : V // 2] = 0
        q = q / q.sum(-1, keepdim=True)
    elif case == "q_support_where_p_zero":
        p[:, V // 2:] = 0
        p = p / p.sum(-1, keepdim=True)
    elif case == "one_hot_q":
        q = None
    elif case in ("top_k", "top_p"):
        lp, lq = torch.randn(K + 1, V, generator=gen), torch.randn(K + 1, V, generator=gen)
        top_k = torch.full((K + 1,), 3 if case == "top_k" else 0)
        top_p = torch.full((K + 1,), 0.8 if case == "top_p" else 1.0)
        temperature = torch.full((K + 1,), 0.7)
        p = compute_probs(lp, temperature, top_k, top_p)
        q = compute_probs(lq, temperature, top_k, top_p)[:K]
        assert ((p > 0).sum(-1) >= 2).all(), "a degenerate nucleus would test nothing"
    return p, q


def run_rejection(p: torch.Tensor, q: torch.Tensor | None, num_draft: torch.Tensor, gen: torch.Generator):
    """N independent verifications of drafts drawn from q (or fixed, deterministic drafts)."""
    K = p.shape[0] - 1
    if q is None:
        # a deterministic drafter proposes the same tokens every time (random per-row drafts would
        # hide a wrong residual: averaged over a uniform x, its bias cancels)
        draft = torch.tensor([2, 5, 1, 6])[:K].expand(N, K)
    else:
        u = torch.rand(N * K, generator=gen, dtype=torch.float64)
        draft = sample_from_probs(q.repeat(N, 1), u).view(N, K)
    draft = torch.where(torch.arange(K)[None] < num_draft[:, None], draft, -1)
    u_accept = torch.rand(N, K, generator=gen, dtype=torch.float64)
    u_sample = torch.rand(N, generator=gen, dtype=torch.float64)
    qb = None if q is None else q.expand(N, K, V)
    return verify_rejection(p.expand(N, K + 1, V), draft, num_draft, qb, u_accept, u_sample)


CASES = ["random", "q_zero_where_p_positive", "q_support_where_p_zero", "one_hot_q", "top_k", "top_p"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_draft", [1, 4, "mixed"])
def test_first_token_is_distributed_as_p0(case, num_draft):
    gen = torch.Generator().manual_seed(10 * CASES.index(case) + [1, 4, "mixed"].index(num_draft))
    K = 4
    p, q = make_case(case, K, gen)
    nd = torch.randint(0, K + 1, (N,), generator=gen) if num_draft == "mixed" else torch.full((N,), num_draft)
    tokens, num_tokens = run_rejection(p, q, nd, gen)
    assert ((num_tokens >= 1) & (num_tokens <= nd + 1)).all()
    assert_samples_from(tokens[:, 0], p[0])
    # every committed token lies in the support of its target distribution, padding is -1
    pos = torch.arange(K + 1)[None]
    committed = pos < num_tokens[:, None]
    assert (tokens[~committed] == -1).all()
    assert (p.expand(N, -1, -1).gather(2, tokens.clamp(min=0)[..., None]).squeeze(2)[committed] > 0).all()


@pytest.mark.parametrize("case", ["random", "one_hot_q", "q_support_where_p_zero", "top_p"])
@pytest.mark.parametrize("num_draft", [1, 4])
def test_second_token_given_first_accepted_is_p1(case, num_draft):
    gen = torch.Generator().manual_seed(1000 + CASES.index(case) + num_draft)
    p, q = make_case(case, 4, gen)
    if q is None:
        # make the deterministic draft's first token (2) likely, so that enough of them are accepted
        p[0] = torch.softmax(torch.randn(V, generator=gen), 0) * 0.2 + 0.8 * torch.nn.functional.one_hot(torch.tensor(2), V)
    tokens, num_tokens = run_rejection(p, q, torch.full((N,), num_draft), gen)
    second = tokens[num_tokens >= 2, 1]
    assert second.numel() > 5_000
    assert_samples_from(second, p[1])


def test_second_token_when_p1_depends_on_the_first_token():
    # the real setting: the target's next distribution depends on the token just accepted
    gen = torch.Generator().manual_seed(7)
    K = 3
    p0, q0 = random_dist(1, gen)[0], random_dist(1, gen)[0]
    table = random_dist(V, gen)           # [V, V]: p_1 given x_1
    x1 = sample_from_probs(q0.expand(N, V), torch.rand(N, generator=gen, dtype=torch.float64))
    draft = torch.stack([x1] + [sample_from_probs(table[x1], torch.rand(N, generator=gen, dtype=torch.float64))
                                for _ in range(K - 1)], dim=1)
    p = torch.cat([p0.expand(N, 1, V), table[x1][:, None], random_dist(K - 1, gen).expand(N, K - 1, V)], dim=1)
    q = torch.cat([q0.expand(N, 1, V), table[x1][:, None].expand(N, K - 1, V)], dim=1)  # q_2.. = p_1 row: accepted
    tokens, num_tokens = verify_rejection(p, draft, torch.full((N,), K), q,
                                          torch.rand(N, K, generator=gen, dtype=torch.float64),
                                          torch.rand(N, generator=gen, dtype=torch.float64))
    assert_samples_from(tokens[:, 0], p0)
    for token in p0.argsort(descending=True)[:2].tolist():
        rows = (num_tokens >= 2) & (tokens[:, 0] == token)
        assert rows.sum() > 2_000
        assert_samples_from(tokens[rows, 1], table[token])


def test_bonus_token_after_full_acceptance_is_pK():
    gen = torch.Generator().manual_seed(11)
    K = 3
    p = random_dist(K + 1, gen)
    tokens, num_tokens = run_rejection(p, p[:K].clone(), torch.full((N,), K), gen)  # q = p: always accepted
    assert (num_tokens == K + 1).all()
    assert_samples_from(tokens[:, K], p[K])


# ---- rejection sampling: exact reductions ------------------------------------------------------

@pytest.mark.parametrize("with_q", [False, True])
def test_one_hot_p_reproduces_verify_greedy(with_q):
    gen = torch.Generator().manual_seed(5)
    B, K = 2_000, 4
    target = torch.randint(0, V, (B, K + 1), generator=gen)
    guess = torch.randint(0, V, (B, K), generator=gen)
    draft = torch.where(torch.rand(B, K, generator=gen) < 0.7, target[:, :K], guess)
    num_draft = torch.randint(0, K + 1, (B,), generator=gen)
    draft = torch.where(torch.arange(K)[None] < num_draft[:, None], draft, -1)
    p = torch.nn.functional.one_hot(target, V).float()
    q = random_dist(B * K, gen).view(B, K, V) if with_q else None
    got = verify_rejection(p, draft, num_draft, q, torch.rand(B, K, generator=gen, dtype=torch.float64),
                           torch.rand(B, generator=gen, dtype=torch.float64))
    want = verify_greedy(target, draft, num_draft)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_greedy_rows_from_compute_probs_match_argmax():
    gen = torch.Generator().manual_seed(6)
    B, K = 64, 3
    logits = torch.randn(B * (K + 1), 32, generator=gen)
    p = compute_probs(logits, torch.zeros(B * (K + 1)), torch.zeros(B * (K + 1), dtype=torch.long),
                      torch.ones(B * (K + 1))).view(B, K + 1, 32)
    target = logits.argmax(-1).view(B, K + 1)
    draft = target[:, :K].clone()
    draft[::3, 1] = (draft[::3, 1] + 1) % 32
    nd = torch.full((B,), K)
    got = verify_rejection(p, draft, nd, None, torch.rand(B, K, dtype=torch.float64), torch.rand(B, dtype=torch.float64))
    want = verify_greedy(target, draft, nd)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_residual_all_zero_falls_back_to_p():
    # x has p(x) = q(x) = 0 (never drawn from q in practice), so it is rejected with p == q and the
    # residual max(p - q, 0) has no mass: the token must then come from p itself
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]])
    draft = t([[2]])  # q(x) = 0 and p(x) = 0: rejected, residual p - q = 0
    tokens, num_tokens = verify_rejection(p, draft, torch.tensor([1]), q, torch.tensor([[0.5]]), torch.tensor([0.75]))
    assert num_tokens.tolist() == [1] and tokens.tolist() == [[1, -1]]
