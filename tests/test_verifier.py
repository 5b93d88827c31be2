"""engine/verifier.py step by step: gather rows, draw the target, accept per draft kind, commit."""
import pytest
import torch

from specserve.engine.scheduler import ScheduledSeq
from specserve.runtime.sequence import Sequence
from specserve.engine.verifier import (accept_chains, accept_tree_draft, committed_rows, draw_target, gather_rows,
                                       verify_step)
from specserve.layers.sampler import compute_probs, position_uniforms, sample_from_probs
from specserve.sampling_params import SamplingParams
from specserve.drafting.proposer import Draft, NoProposer
from specserve.drafting.tree import Tree

V = 6


def seq_of(tokens: list[int], num_computed: int, temperature: float = 0.0, seed: int = 7) -> Sequence:
    seq = Sequence(tokens, SamplingParams(temperature=temperature, seed=seed))
    seq.num_computed_tokens = num_computed
    return seq


def one_hot_logits(argmax: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmax), V).float() * 10      # [N, V]


def step_of_three() -> tuple[list[ScheduledSeq], Draft]:
    """A prompt chunk (3 of 6 tokens), a decoding sequence with a chain of 2, a prompt that completes (2 tokens)."""
    scheduled = [ScheduledSeq(seq_of([1, 2, 3, 4, 5, 0], 0), 3, 0),
                 ScheduledSeq(seq_of([1, 2, 3], 2), 1, 2),
                 ScheduledSeq(seq_of([4, 5], 0), 2, 0)]
    return scheduled, Draft([[], [4, 5], []], trees=[None, None, None])


def test_gather_rows_samples_where_prompts_complete():
    scheduled, draft = step_of_three()
    where = gather_rows(scheduled, draft)
    assert where.offsets == [0, 3, 6]
    assert where.seqs == [1, 2]
    assert where.rows == [[3, 4, 5], [7]]


def test_draw_target_greedy_is_the_argmax():
    seqs = [seq_of([1, 2], 1), seq_of([3], 0)]
    y, p = draw_target(one_hot_logits([2, 3, 1, 4]), seqs, [None, None], 1)
    assert p is None and y.tolist() == [[2, 3], [1, 4]]


def test_draw_target_samples_with_the_uniform_of_each_rows_position():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * 4, V, generator=gen)
    seqs = [seq_of([1, 2, 3], 2, temperature=1.0, seed=11), seq_of([1], 0, temperature=0.7, seed=12)]
    tree = Tree([-1, -1, 0])                                    # depths 1, 1, 2
    y, p = draw_target(logits, seqs, [None, tree], 3)
    temps = torch.tensor([1.0] * 4 + [0.7] * 4)
    want_p = compute_probs(logits, temps, torch.zeros(8, dtype=torch.long), torch.ones(8))
    assert torch.allclose(p.view(8, V), want_p)
    # chain rows sit at len, len+1, ...; tree rows at len + depth
    u = position_uniforms([11, 12], [[3, 4, 5, 6], [1, 2, 2, 3]])
    assert y.tolist() == sample_from_probs(want_p, u.view(-1)).view(2, 4).tolist()


def test_accept_chains_greedy_and_without_drafts():
    seqs = [seq_of([1], 0), seq_of([1], 0), seq_of([1], 0)]
    y = torch.tensor([[4, 5, 9], [4, 7, 9], [3, 0, 0]])
    assert accept_chains(y, None, [[4, 5], [4, 5], []], [None] * 3, seqs) == [[4, 5, 9], [4, 7], [3]]
    assert accept_chains(y[:, :1], None, [[], [], []], [None] * 3, seqs) == [[4], [4], [3]]


def test_accept_chains_takes_the_rejection_rule_for_drafts_sampled_from_q():
    seqs = [seq_of([1, 2], 1, temperature=1.0), seq_of([1, 2], 1, temperature=1.0)]
    p = torch.zeros(2, 2, V)
    p[:, 0, 3] = 1.0                                            # the target puts all its mass on token 3
    p[:, 1, 5] = 1.0
    y = torch.tensor([[3, 5], [3, 5]])
    q = torch.zeros(1, V)
    q[0, 2] = 1.0                                               # row 0 drafted token 2 from q
    got = accept_chains(y, p, [[2], [2]], [q, None], seqs)
    # the rejection rule rejects 2 (p(2) = 0) and resamples from max(p - q, 0): token 3; the deterministic
    # row's draw is also 3, so both commit 3, and neither accepts its draft
    assert got == [[3], [3]]
    q[0] = 0.0
    q[0, 3] = 1.0
    assert accept_chains(y, p, [[3], [3]], [q, None], seqs) == [[3, 5], [3, 5]]


def test_rejection_keeps_a_q_draft_with_probability_p_over_q_and_resamples_the_residual():
    p = torch.zeros(1, 2, V)
    p[0, 0, 2] = p[0, 0, 3] = 0.5
    p[0, 1, 5] = 1.0
    q = torch.zeros(1, V)
    q[0, 2] = 1.0
    got = [accept_chains(torch.tensor([[2, 5]]), p, [[2]], [q], [seq_of([1, 2], 1, temperature=1.0, seed=s)])[0]
           for s in range(200)]
    assert set(map(tuple, got)) == {(2, 5), (3,)}                # kept (then the bonus), or rejected for 3 alone
    assert 60 < got.count([2, 5]) < 140


def test_accept_tree_draft_follows_the_target():
    tree = Tree([-1, -1, 1])
    assert accept_tree_draft(torch.tensor([11, 0, 12, 9, 0]), tree, [10, 11, 12]) == ([11, 12, 9], [1, 2])
    assert accept_tree_draft(torch.tensor([7, 0, 0, 0]), tree, [10, 11, 12]) == ([7], [])


def test_committed_rows_of_chunks_chains_and_trees():
    scheduled, _ = step_of_three()
    scheduled.append(ScheduledSeq(seq_of([1, 2], 1), 1, 3))     # a tree of 3 nodes, rows 8..11
    rows = committed_rows(scheduled, [0, 3, 6, 8], [None, [4, 9], [2], [5, 6]], {3: [2]})
    assert rows == [[0, 1, 2], [3, 4], [6, 7], [8, 11]]


def test_verify_step_end_to_end():
    scheduled, draft = step_of_three()
    # hidden states are the logits themselves: rows 3..5 draw 4, 0, 3 -> the chain [4, 5] keeps 4, then 0
    argmax = [0, 0, 0, 4, 0, 3, 0, 2]
    verified = verify_step(scheduled, draft, one_hot_logits(argmax), lambda h: h)
    assert verified.tokens == [None, [4, 0], [2]]
    assert verified.rows == [[0, 1, 2], [3, 4], [6, 7]]
    assert verified.paths == {}


@pytest.mark.parametrize("temperature, logprobs", [(0.0, None), (0.0, 2), (1.0, None)])
def test_verify_step_computes_logits_at_the_sampling_rows_only(temperature, logprobs):
    """A chain of 5 beside a chain of 1 and a decode row: 9 rows of logits, not 3 x 6 padded to the longest; the
    padded rows of the short ones still draw their last row's token."""
    seqs = [seq_of([1, 2, 3], 2, temperature), seq_of([1, 2], 1, temperature), seq_of([3], 0, temperature)]
    for seq in seqs:
        seq.params.logprobs = logprobs
    scheduled = [ScheduledSeq(seq, 1, n) for seq, n in zip(seqs, [5, 1, 0])]
    draft = Draft([[1, 2, 3, 4, 5], [2], []], trees=[None] * 3)
    argmax = [1, 2, 3, 0, 0, 0, 2, 4, 5]             # chain 1 keeps 1, 2, 3 then 0; chain 2 keeps 2 then 4; then 5
    rows = []
    verified = verify_step(scheduled, draft, one_hot_logits(argmax) * 10, lambda h: rows.append(len(h)) or h)
    assert rows == [9]
    assert verified.tokens == [[1, 2, 3, 0], [2, 4], [5]]   # sampled: near one-hot, the rejection rule agrees
    if logprobs:                                      # each from its own row: the row's most likely token
        assert [[lp.top[0][0] for lp in verified.logprobs[i]] for i in range(3)] == verified.tokens


def test_draft_for_batch_places_rows_cuts_them_and_derives_trees():
    probs = torch.rand(2, 3, V)
    draft = Draft([[1, 2, 3], [4, 5, 6]], probs, [[-1, -1, 0], [-1, 0, 1]])
    batch = draft.for_batch([1, 3], 4, [2, 3])
    assert batch.token_ids == [[], [1, 2], [], [4, 5, 6]]
    assert batch.trees[0] is None and batch.trees[3] is None             # no draft; a chain needs no tree
    assert batch.trees[1].parents == [-1, -1] and batch.parents == [None, [-1, -1], None, None]
    assert torch.equal(batch.probs[1], probs[0]) and torch.equal(batch.probs[3], probs[1])
    assert not batch.probs[0].any() and not batch.probs[2].any()
    nothing = Draft([[7], []]).for_batch([0, 1], 2, [0, 4])
    assert nothing.token_ids == [[], []] and nothing.trees == [None, None] and nothing.probs is None


def test_no_proposer_drafts_nothing():
    proposer = NoProposer()
    assert proposer.max_draft_tokens(SamplingParams(num_assistant_tokens=5)) == 0
    assert proposer.propose([seq_of([1], 0)], [3]).token_ids == [[]]
    assert proposer.aux_layers == () and not proposer.uses_kv_cache
    assert proposer.options == ()
