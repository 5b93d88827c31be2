"""Pieces every drafter shares (drafting/proposer.py)."""
import pytest
import torch

from specserve.runtime.sequence import Sequence
from specserve.layers.sampler import compute_probs, position_uniforms, sample_from_probs
from specserve.sampling_params import SamplingParams, sampling_tensors
from specserve.drafting.proposer import draw_draft_tokens


def seq(temperature: float, seed: int = 3, **kw) -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(temperature=temperature, seed=seed, **kw))


def test_greedy_drafts_take_the_argmax_with_a_one_hot_q_only_when_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    assert draw_draft_tokens(logits, [seq(0), seq(0)], 0, False) == ([1, 0], None)
    tokens, q = draw_draft_tokens(logits, [seq(0), seq(0)], 0, True)
    assert tokens == [1, 0] and q.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_sampled_drafts_use_the_draft_stream_at_their_position():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    seqs = [seq(1.0, seed=5, top_k=10), seq(0)]
    tokens, q = draw_draft_tokens(logits, seqs, 2, False)
    want_q = compute_probs(logits, torch.tensor([1.0, 0.0]), torch.tensor([10, 0]), torch.tensor([1.0, 1.0]))
    assert torch.equal(q, want_q)
    u = position_uniforms([5, 3], [[5], [5]], stream=2)[:, 0]            # sequence length 3 + step 2
    assert tokens == sample_from_probs(want_q, u).tolist()
    assert tokens[1] == int(logits[1].argmax())                           # a greedy row keeps its argmax


def test_sampling_tensors_repeat_each_request():
    t, k, p, m = sampling_tensors([SamplingParams(temperature=0.5, top_k=4, top_p=0.9, min_p=0.1),
                                  SamplingParams(temperature=0)], 2)
    assert m.tolist() == pytest.approx([0.1, 0.1, 0.0, 0.0])
    assert t.tolist() == [0.5, 0.5, 0.0, 0.0] and k.tolist() == [4, 4, 0, 0]
    assert torch.allclose(p, torch.tensor([0.9, 0.9, 1.0, 1.0]))


def test_restart_tail_reads_the_cached_prefixs_last_block():
    from specserve.drafting.catch_up import restart_tail
    tails = torch.arange(5 * 2.0).view(5, 2)                  # 5 blocks, one 2-wide tail each
    s = seq(0)
    s.block_table = [3, 1, 4]
    for computed, want in ((0, None), (4, [6.0, 7.0]), (8, [2.0, 3.0]), (6, None)):
        s.num_drafter_computed = computed
        got = restart_tail(tails, s, 4)
        assert (got if got is None else got.tolist()) == want
    s.num_drafter_computed = 4
    restart_tail(tails, s, 4)[0] = -1.0
    assert tails[3, 0] == 6.0                                 # a copy: the block's tail stays for other hits
