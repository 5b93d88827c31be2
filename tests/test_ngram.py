import numpy as np
import pytest

from specserve.runtime.sequence import Sequence
from specserve.sampling_params import SamplingParams
from specserve.drafting.ngram import NgramCache, NgramProposer, find_ngram_draft


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return find_ngram_draft(np.array(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def reference_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule written as plain loops: longest n first, most recent occurrence first."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


# ---- find_ngram_draft

def test_longest_n_wins():
    # suffix [1, 2, 3]: the 3-gram occurs once (followed by 7); the 1-gram [3] later (followed by 9)
    tokens = [1, 2, 3, 7, 8, 5, 3, 9, 4, 1, 2, 3]
    assert lookup(tokens, 1, 3, 2) == [7, 8]
    assert lookup(tokens, 1, 1, 2) == [9, 4]


def test_min_and_max_respected():
    tokens = [1, 2, 3, 7, 8, 5, 3, 9, 4, 1, 2, 3]
    assert lookup(tokens, 4, 6, 2) == []                # only a 3-gram recurs
    assert lookup(tokens, 2, 2, 2) == [7, 8]            # [2, 3] recurs once, followed by 7
    assert lookup([5, 6, 9, 0, 6], 2, 3, 3) == []       # only [6] recurs, below min_n


def test_no_self_match():
    assert lookup([1, 2, 3], 1, 3, 4) == []
    assert lookup([4], 1, 1, 4) == []
    assert lookup([], 1, 1, 4) == []


def test_repeated_token_overlapping_occurrence():
    # [7, 7, 7] ends at position 3 (overlapping the suffix); its continuation is the final token
    assert lookup([7, 7, 7, 7, 7], 1, 3, 4) == [7]


def test_most_recent_occurrence_chosen():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert lookup(tokens, 2, 2, 1) == [30]


def test_truncated_to_k_and_to_end_of_context():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert lookup(tokens, 2, 2, 3) == [3, 4, 5]
    assert lookup(tokens, 2, 2, 100) == [3, 4, 5, 6, 1, 2]
    assert lookup(tokens, 2, 2, 0) == []


def test_empty_when_nothing_matches():
    assert lookup(list(range(50)), 1, 4, 5) == []


def test_matches_reference_on_random_contexts():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        assert lookup(tokens, min_n, max_n, k) == reference_lookup(tokens, min_n, max_n, k)


def test_invalid_lookup_range_raises():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        lookup([1, 2, 1], 0, 2, 1)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        lookup([1, 2, 1], 3, 2, 1)


# ---- NgramCache

def test_cache_chains_most_frequent_continuation():
    cache = NgramCache(min_n=1, max_n=2)
    cache.update([1, 2, 3, 1, 2, 3, 1, 2, 4])
    # [1, 2] -> 3 twice, 4 once; then [2, 3] -> 1; [3, 1] -> 2; ...
    assert cache.draft(np.array([9, 1, 2]), 5) == [3, 1, 2, 3, 1]
    assert cache.draft(np.array([9, 1, 2]), 0) == []
    assert cache.draft(np.array([8]), 3) == []          # unknown token: nothing drafted


def test_cache_prefers_longest_known_ngram():
    cache = NgramCache(min_n=1, max_n=3)
    cache.update([5, 6, 7, 50])
    cache.update([6, 7, 60, 6, 7, 60])
    assert cache.draft(np.array([5, 6, 7]), 1) == [50]   # 3-gram [5, 6, 7] beats 2-gram [6, 7]
    assert cache.draft(np.array([0, 6, 7]), 1) == [60]


def test_cache_stops_when_nothing_known():
    cache = NgramCache(min_n=2, max_n=2)
    cache.update([1, 2, 3])
    assert cache.draft(np.array([1, 2]), 4) == [3]       # [2, 3] never had a continuation
    cache.update([])
    cache.update([5])
    assert len(cache) == 1
    assert cache.draft(np.array([], dtype=np.int64), 4) == []


def test_cache_min_count_and_share():
    cache = NgramCache(min_n=1, max_n=1, min_count=2)
    cache.update([1, 2, 1, 3])
    assert cache.draft(np.array([1]), 1) == []
    cache.update([1, 2])
    assert cache.draft(np.array([1]), 1) == [2]
    shared = NgramCache(min_n=1, max_n=1, min_share=0.6)
    shared.update([1, 2, 1, 3])
    assert shared.draft(np.array([1]), 1) == []


def test_cache_evicts_least_recently_used():
    cache = NgramCache(min_n=1, max_n=1, max_entries=2)
    cache.update([1, 10])
    cache.update([2, 20])
    assert cache.draft(np.array([1]), 1) == [10]         # touches (1,): (2,) is now least recent
    cache.update([3, 30])
    assert len(cache) == 2
    assert (2,) not in cache
    assert cache.draft(np.array([1]), 1) == [10]
    assert cache.draft(np.array([3]), 1) == [30]


def test_cache_invalid_params_raise():
    with pytest.raises(ValueError, match="min_n"):
        NgramCache(min_n=0)
    with pytest.raises(ValueError, match="max_n"):
        NgramCache(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="max_entries"):
        NgramCache(max_entries=0)


# ---- NgramProposer

def make_seq(tokens: list[int], **options) -> Sequence:
    return Sequence(tokens, SamplingParams(draft_options=options))


def test_proposer_drafts_at_most_num_tokens():
    seqs = [make_seq([1, 2, 3, 4, 5, 6, 1, 2]), make_seq([9, 8, 7]), make_seq([4, 5, 0, 4, 5])]
    draft = NgramProposer().propose(seqs, [2, 3, 5])
    assert draft.token_ids == [[3, 4], [], [0, 4, 5]]
    assert draft.probs is None and draft.parents is None


def test_proposer_follows_growing_and_shrinking_sequences():
    proposer = NgramProposer(use_cache=False)
    seq = make_seq([1, 2, 3, 4])
    assert proposer.propose([seq], [3]).token_ids == [[]]
    seq.token_ids += [1, 2]
    assert proposer.propose([seq], [3]).token_ids == [[3, 4, 1]]
    seq.token_ids += [3, 9, 1, 2]
    assert proposer.propose([seq], [3]).token_ids == [[3, 9, 1]]
    del seq.token_ids[-3:]                             # shorter: [1, 2, 3, 4, 1, 2, 3]
    assert proposer.propose([seq], [3]).token_ids == [[4, 1, 2]]
    seq.token_ids[-1] = 5                              # same length, rewritten: [..., 1, 2, 5]
    assert proposer.propose([seq], [3]).token_ids == [[]]
    for _ in range(40):                                # buffer regrows many times
        seq.token_ids += [7, 8]
    assert proposer.propose([seq], [2]).token_ids == [[7, 8]]


def test_draftable_is_the_lookups_length_and_propose_reuses_its_draft():
    """The scheduler reserves draft slots for what the lookup finds, not for the k asked (an empty reservation took a
    prompt token's slot for nothing), and propose() in the same step returns that draft, cut to the slots given."""
    proposer = NgramProposer(use_cache=False)
    seq, none = make_seq([1, 2, 3, 4, 5, 1, 2]), make_seq([9, 8, 7])
    assert proposer.draftable(seq, 8) == 5 and proposer.draftable(none, 8) == 0
    assert proposer.propose([seq], [3]).token_ids == [[3, 4, 5]]
    assert proposer.draftable(seq, 2) == 2
    seq.token_ids += [3]                                # the sequence moved on: looked up again, not the kept draft
    assert proposer.propose([seq], [4]).token_ids == [[4, 5, 1, 2]]
    assert proposer.draftable(seq, 1) == 1 and proposer.propose([seq], [3]).token_ids == [[4, 5, 1]]   # k past it


def test_request_lookup_range_overrides_the_default():
    tokens = [1, 2, 3, 7, 8, 5, 3, 9, 4, 1, 2, 3]
    proposer = NgramProposer(use_cache=False)
    assert proposer.propose([make_seq(tokens)], [1]).token_ids == [[7]]          # default range 2..4
    assert proposer.propose([make_seq(tokens, prompt_lookup_min=1, prompt_lookup_max=1)], [1]).token_ids == [[9]]
    assert proposer.propose([make_seq(tokens, prompt_lookup_min=4, prompt_lookup_max=5)], [1]).token_ids == [[]]
    assert proposer.lookup_range(SamplingParams(draft_options={"prompt_lookup_min": 3})) == (3, 4)


def test_cache_used_only_when_context_has_no_match():
    cache = NgramCache(min_n=1, max_n=2)
    cache.update([40, 41, 42, 43])
    proposer = NgramProposer(cache=cache)
    in_context = make_seq([41, 42, 50, 51, 41, 42])    # context match [50, 51] wins over cache [43]
    no_match = make_seq([7, 41])
    assert proposer.propose([in_context, no_match], [2, 2]).token_ids == [[50, 51], [42, 43]]
    without_cache = NgramProposer(use_cache=False, cache=cache)
    assert without_cache.propose([no_match], [2]).token_ids == [[]]


def test_on_finished_feeds_cache_unless_aborted():
    proposer = NgramProposer()
    finished, aborted = make_seq([1, 2, 3]), make_seq([4, 5, 6])
    proposer.propose([finished, aborted], [1, 1])
    finished.finish_reason, aborted.finish_reason = "length", "abort"
    proposer.on_finished(finished)
    proposer.on_finished(aborted)
    assert not proposer._buffers
    assert proposer.propose([make_seq([0, 2]), make_seq([0, 5])], [2, 2]).token_ids == [[3], []]
    proposer.on_finished(make_seq([1]))                # never proposed for: nothing to drop


def test_proposer_invalid_params_raise():
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        NgramProposer().check(SamplingParams(draft_options={"prompt_lookup_min": 3, "prompt_lookup_max": 2}))
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer().check(SamplingParams(draft_options={"prompt_lookup_min": 0}))
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        NgramProposer().propose([make_seq([1, 2], prompt_lookup_min=3, prompt_lookup_max=2)], [1])
