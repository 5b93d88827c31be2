"""The engine's tree path (tree forward with a tree mask, exact tree verification, K/V compaction of
the accepted path) driven by a tree-shaped drafter: each token of the draft model's chain gets random
siblings, laid out breadth first so an accepted path is scattered over the tree's slots."""
import numpy as np
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.drafting.draft_model import DraftModelProposer
from specserve.drafting.proposer import Draft

from stats import assert_samples_from, second_token_marginal
from test_spec import PROMPTS, damped_pair, ids  # noqa: F401  (fixture)


class BranchingDraft(DraftModelProposer):

    def __init__(self, path, ctx, width: int = 3):
        super().__init__(path, ctx)
        self.vocab_size, self.width = ctx.target_config.vocab_size, width
        self.rng = np.random.default_rng(0)
        self.chains = {}

    def on_target_forward(self, seqs, hidden):
        # the draft's cache holds its own chain: valid only as far as the committed tokens follow it
        for seq in seqs:
            if seq.seq_id in self.chains:
                start, chain = self.chains.pop(seq.seq_id)
                committed = seq.token_ids[start:start + len(chain)]
                match = next((i for i, (a, b) in enumerate(zip(chain, committed)) if a != b), len(committed))
                self.pending[seq.seq_id] = (start, match + 1)
        return super().on_target_forward(seqs, hidden)

    def propose(self, seqs, num_draft_tokens):
        chains = super().propose(seqs, num_draft_tokens).token_ids
        for seq, chain in zip(seqs, chains):
            self.chains[seq.seq_id] = (len(seq), chain)
        token_ids, parents = [], []
        for chain, k in zip(chains, num_draft_tokens):
            tokens, par, prev_level = [], [], [-1]
            for t in chain:
                level = []
                for parent in prev_level[:1]:          # expand the first node of the previous level
                    siblings = [t] + [int(x) for x in self.rng.choice(self.vocab_size, self.width - 1, replace=False) if x != t]
                    self.rng.shuffle(siblings)
                    for s in siblings:
                        if len(tokens) < k:
                            tokens.append(s)
                            par.append(parent)
                            level.append(len(tokens) - 1)
                # the chain continues under the node carrying the n-gram token
                prev_level = [j for j in level if tokens[j] == t] + [j for j in level if tokens[j] != t]
            token_ids.append(tokens)
            parents.append(par)
        return Draft(token_ids=token_ids, parents=parents)


@pytest.fixture
def tree_llm(damped_pair):
    llm = LLM(str(damped_pair), kv_cache_memory_gb=0.05, speculative_method="draft", max_num_seqs=256)
    engine = llm.engine
    engine.proposer = BranchingDraft(damped_pair / "draft", engine.drafter_context)
    return llm


def test_tree_greedy_equals_plain(tree_llm, damped_pair):
    plain = LLM(str(damped_pair), kv_cache_memory_gb=0.01, speculative_method="none")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = ids(plain.generate(PROMPTS, params))
    for k in (2, 5, 9):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, num_assistant_tokens=k)
        outs = tree_llm.generate(PROMPTS, params)
        assert ids(outs) == expected
        assert sum(o.spec["num_accepted_tokens"] for o in outs) > 0


def test_tree_sampling_equals_plain_sampling(tree_llm, damped_pair):
    """Deterministic trees are verified by sampling with per-position uniforms: seeded output equals
    plain seeded sampling token for token, for temperature, top-k and top-p."""
    plain = LLM(str(damped_pair), kv_cache_memory_gb=0.01, speculative_method="none")
    for kw in (dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.2, top_p=0.8)):
        params = SamplingParams(max_tokens=30, ignore_eos=True, seed=5, num_assistant_tokens=6, **kw)
        assert ids(tree_llm.generate(PROMPTS, params)) == ids(plain.generate(PROMPTS, params))


def test_tree_sampled_distribution(tree_llm):
    """Unseeded: the second output token's empirical distribution matches the target's exact marginal."""
    llm = tree_llm
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown")
    n = 3000
    outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True,
                                                     num_assistant_tokens=4))
    assert sum(o.spec["num_drafts"] for o in outs) > 0
    second = [o.outputs[0].token_ids[1] for o in outs]
    assert_samples_from(second, second_token_marginal(llm.engine.model, prompt), lump_below=5)
