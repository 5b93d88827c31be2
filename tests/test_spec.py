"""Speculative decoding end to end: exactness for every drafting method."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.runtime.model_runner import ForwardItem, ModelRunner
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

from conftest import make_checkpoint, make_drafts_free
from stats import assert_samples_from, second_token_marginal

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
           "To be, or not to be, that is the question",
           "The quick brown fox jumps over the lazy dog. The quick brown fox"]


@pytest.fixture(scope="module")
def damped_pair(tmp_path_factory):
    """A 4-layer target whose last two layers are damped, with a draft made of its first two layers:
    they agree often but not always, so both acceptance and rejection are exercised."""
    root = tmp_path_factory.mktemp("damped")
    target = make_checkpoint(root / "target", "qwen3", layers=4, seed=3, initializer_range=0.2)
    weights = load_file(target / "model.safetensors")
    for name in list(weights):
        if name.startswith(("model.layers.2.", "model.layers.3.")) and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.15
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    draft = make_checkpoint(target / "draft", "qwen3", layers=2, seed=3, initializer_range=0.2)
    draft_weights = {k: v for k, v in weights.items() if not k.startswith(("model.layers.2.", "model.layers.3."))}
    save_file(draft_weights, draft / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def plain(damped_pair):
    return LLM(str(damped_pair), kv_cache_memory_gb=0.01, speculative_method="none")


@pytest.fixture(scope="module", params=["ngram", "draft"])
def spec_llm(request, damped_pair):
    return LLM(str(damped_pair), kv_cache_memory_gb=0.01, speculative_method=request.param)


def greedy(max_tokens=40, **kw):
    return SamplingParams.from_dict(dict(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw))


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def check_hits_past_the_drafters_blocks(llm: LLM, plain: LLM, prompts: list[str], restarts: bool) -> None:
    """A request that drafts nothing caches its prompt's blocks target-only: a later drafting request hits them
    all, and its drafter restarts past them (`restarts`: EAGLE3, MTP) or catches up over them (a draft model),
    with plain decoding's output. A request that drafted from scratch caches them with the drafter's K/V: a hit
    on those resumes the drafter there, as a miss would."""
    engine, bs = llm.engine, llm.engine.block_manager.block_size

    def run(prompt: str, k: int):
        seq = engine.add_request(llm.tokenizer.encode(prompt), greedy(24, num_assistant_tokens=k))
        engine.step()
        seq.hit_drafter_blocks = seq.num_drafter_blocks          # as allocated (freed blocks count none)
        while engine.has_unfinished():
            engine.step()
        assert seq.output_token_ids == ids(plain.generate(prompt, greedy(24)))[0]
        return seq
    first, fresh = prompts
    run(first, 0)
    for again in (False, True):  # the second hit finds the first hit's blocks: target-only after a restart
        seq = run(first, 3)
        assert seq.num_cached_tokens >= 8 and seq.spec.num_draft_tokens > 0
        assert seq.hit_drafter_blocks == (seq.num_cached_tokens // bs if again and not restarts else 0)
        assert seq.drafter_start == (seq.num_cached_tokens if restarts else 0)
    drafted = run(fresh, 3)
    assert drafted.num_cached_tokens == 0 and drafted.spec.num_draft_tokens > 0
    seq = run(fresh, 3)
    assert seq.num_cached_tokens >= 8 and seq.drafter_start == 0 and seq.spec.num_draft_tokens > 0
    assert seq.hit_drafter_blocks * bs == seq.num_cached_tokens


def test_draft_model_catches_up_over_blocks_cached_without_it(damped_pair, plain):
    llm = LLM(str(damped_pair), kv_cache_memory_gb=0.01, speculative_method="draft", block_size=4)
    check_hits_past_the_drafters_blocks(llm, plain, PROMPTS[:2], restarts=False)


def test_greedy_equals_plain_for_every_draft_length(spec_llm, plain):
    expected = ids(plain.generate(PROMPTS, greedy()))
    accepted = 0
    for k in range(1, 9):
        outs = spec_llm.generate(PROMPTS, greedy(num_assistant_tokens=k))
        assert ids(outs) == expected, f"k={k}"
        for p in PROMPTS:
            single = spec_llm.generate(p, greedy(num_assistant_tokens=k))
            assert ids(single) == [expected[PROMPTS.index(p)]]
        accepted += sum(o.spec["num_accepted_tokens"] for o in outs)
        # the draft model drafts at every step; the n-gram cache holds the earlier runs' tokens (the same
        # outputs), so from the second draft length on every request finds its continuation there
        if spec_llm.engine.spec_method == "draft" or k > 1:
            assert all(o.spec["num_drafts"] > 0 and o.spec["num_accepted_tokens"] > 0 for o in outs), f"k={k}"
    assert accepted > 0


def test_mixed_draft_lengths_in_one_batch(spec_llm, plain):
    expected = ids(plain.generate(PROMPTS * 2, greedy()))
    params = [greedy(num_assistant_tokens=k) for k in (0, 1, 3, 5, 8, 2)]
    outs = spec_llm.generate(PROMPTS * 2, params)
    assert ids(outs) == expected
    assert outs[0].spec["num_drafts"] == 0


def test_stops_inside_an_accepted_run_cut_exactly(spec_llm, plain):
    base = plain.generate(PROMPTS[0], greedy())[0].outputs[0]
    for max_tokens in (3, 7, 11):
        out = spec_llm.generate(PROMPTS[0], greedy(max_tokens, num_assistant_tokens=6))[0].outputs[0]
        assert out.token_ids == base.token_ids[:max_tokens] and out.finish_reason == "length"
    for cut in (4, 9):
        token = base.token_ids[cut]
        first = base.token_ids.index(token)
        out = spec_llm.generate(PROMPTS[0], greedy(stop_token_ids=[token], num_assistant_tokens=6))[0].outputs[0]
        assert out.token_ids == base.token_ids[:first + 1] and out.stop_reason == token
    stop = base.text[12:15]
    out = spec_llm.generate(PROMPTS[0], greedy(stop=[stop], num_assistant_tokens=6))[0].outputs[0]
    assert out.text == base.text[:base.text.index(stop)]


def test_kv_cache_after_rejection_equals_plain(damped_pair):
    llm = LLM(str(damped_pair), kv_cache_memory_gb=0.01, speculative_method="draft")
    engine, bs = llm.engine, llm.engine.block_manager.block_size
    seq = engine.add_request(llm.tokenizer.encode(PROMPTS[1]), greedy(60, num_assistant_tokens=4))
    rejected = False
    while not seq.is_finished:
        engine.step()
        stats = seq.spec
        if stats.num_drafts and stats.num_accepted_tokens < stats.num_draft_tokens and not seq.is_finished:
            rejected = True
            break
    assert rejected, "the damped draft never disagreed"
    n = seq.num_computed_tokens
    slots = torch.from_numpy(engine.runner.slots(seq.block_table, 0, n))
    got = engine.runner.kv_cache[:, slots]
    c = engine.model_config
    fresh = ModelRunner(engine.model, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 16, 16, torch.float32)
    fresh.forward([ForwardItem(list(range(16)), 0, seq.token_ids[:n])])
    assert torch.allclose(got, fresh.kv_cache[:, :n], atol=1e-5)
    # the draft's own cache holds what a fresh draft forward would, for the tokens it claims
    m = seq.num_drafter_computed
    assert m > 0
    draft = engine.proposer
    dslots = torch.from_numpy(draft.runner.slots(seq.block_table, 0, m))
    dc = draft.config
    dfresh = ModelRunner(draft.model, dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim, 16, 16, torch.float32)
    dfresh.forward([ForwardItem(list(range(16)), 0, seq.token_ids[:m])])
    assert torch.allclose(draft.runner.kv_cache[:, dslots], dfresh.kv_cache[:, :m], atol=1e-5)


@pytest.mark.parametrize("draft_seed,k", [(3, 3), (11, 3), (3, "auto")])
def test_sampled_speculative_output_has_the_target_distribution(damped_pair, tmp_path, draft_seed, k, monkeypatch):
    """Token 2 of a sampled request is produced by verification; its marginal must equal the target's.
    Draft seed 3 is the damped target's own first layers (q close to p), seed 11 an unrelated model; with
    "auto" the policy picks each step's draft lengths."""
    draft = damped_pair / "draft"
    if draft_seed != 3:
        draft = make_checkpoint(tmp_path / "other", "qwen3", layers=2, seed=draft_seed, initializer_range=0.2)
    llm = LLM(str(damped_pair), kv_cache_memory_gb=0.05, draft_model=str(draft),
              max_num_seqs=16 if k == "auto" else 256)
    if k == "auto":     # whether drafts pay depends on this CPU's measured costs: here they are made to
        make_drafts_free(llm, monkeypatch)
    prompt = llm.tokenizer.encode("The quick brown")
    n = 3000
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i,
                                                      num_assistant_tokens=k) for i in range(n)])
    assert sum(o.spec["num_drafts"] for o in outs) > 0
    accepted = sum(o.spec["num_accepted_tokens"] for o in outs)
    assert 0 < accepted < sum(o.spec["num_draft_tokens"] for o in outs)
    second = [o.outputs[0].token_ids[1] for o in outs]
    assert_samples_from(second, second_token_marginal(llm.engine.model, prompt), lump_below=5)


def test_seeded_speculative_sampling_is_reproducible(spec_llm, plain):
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True,
                            num_assistant_tokens=4)
    first = ids(spec_llm.generate(PROMPTS, params))
    assert ids(spec_llm.generate(PROMPTS, params)) == first
    if spec_llm.engine.spec_method == "ngram":
        # deterministic drafts are verified by sampling with per-position uniforms: the seeded
        # output is exactly plain decoding's, whatever the drafts were
        assert first == ids(plain.generate(PROMPTS, params))


def test_draft_with_another_vocabulary_is_rejected(tmp_path, damped_pair):
    import shutil
    target = tmp_path / "t"
    shutil.copytree(damped_pair, target, ignore=shutil.ignore_patterns("draft"))
    make_checkpoint(target / "draft", "qwen3", vocab_size=300)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(target), kv_cache_memory_gb=0.01, speculative_method="draft")


def test_generation_config_sets_default_draft_length(damped_pair, tmp_path):
    import json, shutil
    model = tmp_path / "m"
    shutil.copytree(damped_pair, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["num_assistant_tokens"] = 2
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(model), kv_cache_memory_gb=0.01, speculative_method="draft")
    out = llm.generate(PROMPTS[0], greedy(20))[0]
    assert out.spec["num_draft_tokens"] == 2 * out.spec["num_drafts"] > 0           # generation_config
    out = llm.generate(PROMPTS[0], greedy(20, num_assistant_tokens=3))[0]
    assert max(out.spec["num_draft_tokens"] / out.spec["num_drafts"], 0) > 2        # the request wins
    llm = LLM(str(damped_pair), kv_cache_memory_gb=0.01, speculative_method="draft")
    out = llm.generate(PROMPTS[0], greedy(20))[0]
    assert llm.engine.draft_defaults["num_assistant_tokens"] == "auto"                  # built-in default
    assert out.spec["draft_lengths"] and all(0 <= k <= 8 for k in out.spec["draft_lengths"])
    # a fixed number is obeyed exactly: every decode step but the last ones (no room left) drafts it
    out = llm.generate(PROMPTS[0], greedy(20, num_assistant_tokens=3))[0]
    assert set(out.spec["draft_lengths"][:-3]) == {3}
