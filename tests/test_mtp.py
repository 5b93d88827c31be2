"""MTP drafting: the DeepSeek-V3 layout, `specserve train mtp`, exactness, and prefix caching."""
import json
import shutil
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specserve.llm import LLM
from specserve.models.mtp import (MultiTokenPredictor, load_mtp, save_mtp_folder, save_mtp_into_checkpoint,
                                  shift_right)
from specserve.models.registry import load_model
from specserve.sampling_params import SamplingParams
from specserve.drafting.factory import drafter_kind
from specserve.drafting.catch_up import catch_up_rows
from specserve.train.cli import main as train_main

from conftest import TEXT, make_checkpoint
from stats import assert_second_token_is_the_targets
from test_spec import PROMPTS, check_hits_past_the_drafters_blocks, damped_pair, greedy, ids  # noqa: F401  (damped_pair is a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype")
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def trained(damped_pair, tmp_path_factory):
    """The damped target with 2 MTP layers trained by `specserve train mtp` into its own checkpoint. A few
    steps on a tiny corpus: they draft poorly, but every input (the hidden states above all) counts."""
    root = tmp_path_factory.mktemp("mtp")
    target = root / "target"
    shutil.copytree(damped_pair, target, ignore=shutil.ignore_patterns("draft"))
    (root / "text.txt").write_text(TEXT)
    train_main(["train", "mtp", "--target", str(target), "--layers", str(NUM_LAYERS), "--max-steps", "30",
                "--batch-size", "4", "--seq-len", "64", "--lr", "3e-3", "--corpus", str(root / "text.txt"),
                "--dtype", "float32", "--reuse-steps", "1"])
    return target


@pytest.fixture(scope="module")
def accurate(tmp_path_factory):
    """A target that is nearly its first layer (layers 1-3 damped) with MTP layers that copy that layer and
    feed it the token's embedding at its own scale: they agree with the target often but not always, so
    drafting accepts and rejects (a random target's greedy text is beyond a few training steps)."""
    target = make_checkpoint(tmp_path_factory.mktemp("accurate"), "qwen3", layers=4, seed=3, initializer_range=0.2)
    weights = load_file(target / "model.safetensors")
    for name in list(weights):
        if name.startswith(("model.layers.1.", "model.layers.2.", "model.layers.3.")) and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.15
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    model = load_model(target)
    H = model.config.hidden_size
    embed_rms = model.model.embed_tokens.weight.pow(2).mean().sqrt()
    mtp = MultiTokenPredictor(model.config, NUM_LAYERS)
    for layer in mtp.layers:
        layer.load_state_dict(model.model.layers[0].state_dict(), strict=False)
        with torch.no_grad():
            layer.eh_proj.weight.copy_(torch.cat([embed_rms * torch.eye(H), torch.zeros(H, H)], dim=1))
    save_mtp_into_checkpoint(mtp, target, torch.float32)
    return target


@pytest.fixture(scope="module")
def plain(accurate):
    return LLM(str(accurate), kv_cache_memory_gb=0.01, speculative_method="none")


@pytest.fixture(scope="module")
def mtp_llm(accurate):
    return LLM(str(accurate), kv_cache_memory_gb=0.01, block_size=4)


def record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(sequence tokens, draft) of every proposal the engine makes from now on."""
    proposer, seen = llm.engine.proposer, []
    propose = proposer.propose

    def recording(seqs, num_draft_tokens):
        draft = propose(seqs, num_draft_tokens)
        seen.extend((list(seq.token_ids), d) for seq, d in zip(seqs, draft.token_ids))
        return draft
    proposer.propose = recording
    return seen


@torch.no_grad()
def reference_draft(mtp, target, tokens: list[int], k: int) -> list[int]:
    """Greedy MTP drafts recomputed without any cache: step j < N is layer j over tokens + drafts so far;
    past N the last layer reads its own output at the slot before (slot by slot)."""
    N, c, drafts = mtp.num_layers, len(tokens) - 1, []
    for step in range(k):
        input_ids = torch.tensor([tokens + drafts])
        positions = torch.arange(input_ids.shape[1])
        hidden, _ = target(input_ids, positions)
        embeds = target.model.embed_tokens(input_ids)
        embeds[:, 0] = 0
        layer = min(step, N - 1)
        for d in range(layer):
            hidden = mtp(d, embeds, shift_right(hidden), positions)
        reads = shift_right(hidden)
        for s in range(c + N, c + step + 1):
            reads[:, s] = mtp(layer, embeds, reads, positions)[:, s - 1]
        out = mtp(layer, embeds, reads, positions)
        drafts.append(int(mtp.compute_logits(layer, out[:, -1], target).argmax()))
    return drafts


def test_written_in_the_deepseek_layout(trained):
    config = json.loads((trained / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == NUM_LAYERS and config["architectures"] == ["Qwen3ForCausalLM"]
    L, H = config["num_hidden_layers"], config["hidden_size"]
    with safe_open(str(trained / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice(f"model.layers.{L}.eh_proj.weight").get_shape() == [H, 2 * H]
    for i in range(L, L + NUM_LAYERS):
        for part in ("enorm.weight", "hnorm.weight", "self_attn.q_proj.weight", "self_attn.k_norm.weight",
                     "mlp.gate_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert f"model.layers.{i}.{part}" in names
        assert not any(n.startswith(f"model.layers.{i}.shared_head") for n in names)   # the target's are shared
    assert "model.layers.0.self_attn.q_proj.weight" in names                          # the target is intact
    assert load_model(trained).config.num_hidden_layers == L


def test_training_lowers_the_loss(trained):
    summary = json.loads((trained / ".ckpt" / "mtp_training_summary.json").read_text())
    assert summary["steps"] == 30 and summary["last_loss"] < 0.85 * summary["first_loss"]


def test_deepseek_checkpoint_with_its_own_head_loads(trained, tmp_path):
    """DeepSeek ships shared_head.norm / shared_head.head and an embed_tokens copy in each MTP layer."""
    target_dir = tmp_path / "t"
    shutil.copytree(trained, target_dir)
    weights = load_file(target_dir / "model.safetensors")
    config = json.loads((target_dir / "config.json").read_text())
    L, V, H = config["num_hidden_layers"], config["vocab_size"], config["hidden_size"]
    head = torch.randn(V, H)
    for i in range(L, L + NUM_LAYERS):
        weights[f"model.layers.{i}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[f"model.layers.{i}.shared_head.norm.weight"] = torch.full((H,), 2.0)
        weights[f"model.layers.{i}.shared_head.head.weight"] = head.clone()
    save_file(weights, target_dir / "model.safetensors", metadata={"format": "pt"})
    target = load_model(target_dir)
    mtp = load_mtp(target_dir, target.config)
    h = torch.randn(3, H)
    expected = torch.nn.functional.rms_norm(h, (H,), torch.full((H,), 2.0), target.config.rms_norm_eps) @ head.T
    assert torch.allclose(mtp.compute_logits(1, h, target), expected, atol=1e-4)
    weights[f"model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight"] = head.clone()    # an MLA layer is not the target's kind
    save_file(weights, target_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="target's kind"):
        load_mtp(target_dir, target.config)


def test_detected_and_logged(mtp_llm, accurate, caplog):
    assert mtp_llm.engine.spec_method == "mtp"
    with caplog.at_level("INFO"):
        LLM(str(accurate), kv_cache_memory_gb=0.01, speculative_method="mtp", num_assistant_tokens=4)
    assert "drafting with the 2 MTP layer(s)" in caplog.text
    assert "draft steps 3..4 reuse the last layer" in caplog.text


def test_greedy_equals_plain_past_the_number_of_layers(mtp_llm, plain):
    expected = ids(plain.generate(PROMPTS, greedy()))
    accepted, drafted = 0, 0
    for k in range(1, 7):
        outs = mtp_llm.generate(PROMPTS, greedy(num_assistant_tokens=k))
        assert ids(outs) == expected, f"k={k}"
        assert ids([mtp_llm.generate(PROMPTS[1], greedy(num_assistant_tokens=k))[0]]) == [expected[1]]
        accepted += sum(o.spec["num_accepted_tokens"] for o in outs)
        drafted += sum(o.spec["num_draft_tokens"] for o in outs)
    assert 0 < accepted < drafted


def test_drafts_equal_a_cache_free_recomputation(trained):
    """The cached drafting (catch-up on the target's hidden states, tails, layer reuse past N) drafts what
    the layers recomputed from scratch draft, in a batch and with a block size that splits the prompts."""
    llm = LLM(str(trained), kv_cache_memory_gb=0.01, block_size=4)
    seen = record_drafts(llm)
    for k in (1, 2, 3, 6):
        llm.generate(PROMPTS, greedy(20, num_assistant_tokens=k))
    mtp, target = llm.engine.proposer.mtp, llm.engine.model
    for tokens, draft in seen[::3]:
        assert draft == reference_draft(mtp, target, tokens, len(draft))


def test_drafts_exact_when_drafting_pauses_and_layers_run_only_to_draft(trained, monkeypatch):
    """Steps that draft nothing leave the target's states pending: the layers catch up in one forward when
    drafting resumes, so the drafts still equal a cache-free recomputation; a request that never drafts
    never runs the layers, unless MAX_PENDING_TOKENS states wait."""
    llm = LLM(str(trained), kv_cache_memory_gb=0.01, block_size=4)
    rng = np.random.default_rng(1)
    llm.engine.policy.choose_afresh = lambda candidates, *_: [int(rng.choice([0, 0, 0, c.max_tokens])) for c in candidates]
    seen = record_drafts(llm)
    llm.generate(PROMPTS, greedy(24))
    assert len(seen) > 4
    mtp, target = llm.engine.proposer.mtp, llm.engine.model
    for tokens, draft in seen[::2]:
        assert draft == reference_draft(mtp, target, tokens, len(draft))
    proposer, calls = llm.engine.proposer, []
    catch_up = proposer._catch_up
    proposer._catch_up = lambda work: (calls.append(len(work)) if work else None, catch_up(work))
    llm.generate(PROMPTS[0], greedy(24, num_assistant_tokens=0))
    assert calls == []
    monkeypatch.setattr("specserve.drafting.catch_up.MAX_PENDING_TOKENS", 8)
    llm.generate(PROMPTS[0] + " again", greedy(24, num_assistant_tokens=0))
    assert 2 <= sum(calls) <= 6


def test_a_windowed_catch_up_runs_the_layers_over_its_last_rows_only_and_stays_exact(trained):
    """With a catch-up window, a sequence that starts or resumes drafting runs the layers over the last `window`
    committed tokens (and its last token's slot) only: they restart there, attending nothing before, and layer 0's
    draft equals a cache-free run over those tokens. Greedy output stays plain decoding's."""
    window = 3
    llm = LLM(str(trained), kv_cache_memory_gb=0.01, block_size=4, speculative_catch_up_window=window)
    rng = np.random.default_rng(2)
    llm.engine.policy.choose_afresh = lambda candidates, *_: [int(rng.choice([0, 0, 0, c.max_tokens])) for c in candidates]
    proposer, rows, seen = llm.engine.proposer, [], []
    catch_up, propose = proposer._catch_up, proposer.propose
    proposer._catch_up = lambda work: (rows.extend(st.num_pending for _, st in work), catch_up(work))[1]

    def recording(seqs, num_draft_tokens):
        draft = propose(seqs, num_draft_tokens)
        seen.extend((list(seq.token_ids), seq.drafter_start, d) for seq, d in zip(seqs, draft.token_ids) if d)
        return draft
    proposer.propose = recording
    plain = LLM(str(trained), kv_cache_memory_gb=0.01, speculative_method="none")
    assert ids(llm.generate(PROMPTS, greedy(24))) == ids(plain.generate(PROMPTS, greedy(24)))
    assert max(rows) > window + 1, "no backlog longer than the window"
    assert any(start > 0 for _, start, _ in seen)
    mtp, target = proposer.mtp, llm.engine.model
    for tokens, start, draft in seen:
        if start:
            input_ids = torch.tensor([tokens])
            hidden, _ = target(input_ids, torch.arange(len(tokens)))
            out = mtp(0, target.model.embed_tokens(input_ids[:, start:]), hidden[:, start - 1:-1],
                      torch.arange(start, len(tokens)))
            assert draft[0] == int(mtp.compute_logits(0, out[:, -1], target).argmax())


def test_the_layers_forward_after_a_step_is_priced_per_step_that_drafts(trained):
    """After a step, the layers run over the committed tokens of every sequence that drafted (their next draft's
    first forward): that is drafting's cost too, once a step whatever the drafts' lengths, so "auto" prices it with
    e and d, apart from the per-token c and per-step h of propose() (at one sequence it was 2.4 ms of a draft step's
    3.8 on the default model; laid on the draft tokens, it made every token after the first look as dear)."""
    llm = LLM(str(trained), kv_cache_memory_gb=0.01)
    proposer, costs = llm.engine.proposer, llm.engine.policy.costs
    catch_up = proposer._catch_up
    proposer._catch_up = lambda work: (time.sleep(0.03) if work else None, catch_up(work))
    llm.generate(PROMPTS[0], greedy(12, num_assistant_tokens=2))
    assert costs.deferred_fit.count >= 3 and costs.per_draft_call + costs.per_draft_seq >= 0.02
    assert costs.per_draft_token + costs.per_draft_step < 0.01


def test_a_catch_up_in_propose_is_timed_apart_and_priced_as_a_catch_up(trained):
    """A sequence that drafts again after steps held at 0 first runs the layers over its backlog, inside propose().
    Timed apart (Proposer.catch_up_seconds), that time is the catch-up's (a per sequence, r per token caught up on)
    and not the draft's: fitted with the draft tokens, MTP's first call at 4 sonnet requests (3 sequences, 65 tokens
    each, one draft token each) priced a first draft token at 4.1 ms against 2.1 and held the round at 0."""
    llm = LLM(str(trained), kv_cache_memory_gb=0.01)
    rng = np.random.default_rng(0)
    llm.engine.policy.choose_afresh = lambda candidates, *_: [int(rng.choice([0, 0, c.max_tokens])) for c in candidates]
    proposer, costs = llm.engine.proposer, llm.engine.policy.costs
    catch_up, propose, proposing, caught_up = proposer._catch_up, proposer.propose, [], []

    def slow_in_propose(work):
        if work and proposing:
            caught_up.append(sum(catch_up_rows(st.num_pending, proposer.window) for _, st in work))
            time.sleep(0.03)
        return catch_up(work)
    proposer._catch_up = slow_in_propose
    proposer.propose = lambda *args: (proposing.append(1), propose(*args), proposing.clear())[1]
    llm.generate(PROMPTS, greedy(24))
    assert len(caught_up) >= 2 and costs.catch_up_fit.count == len(caught_up)
    assert costs.drafting([1], [max(caught_up)]) - costs.drafting([1]) >= 0.01
    assert costs.drafting([1]) < 0.01


def test_mixed_draft_lengths_and_max_tokens_unset(mtp_llm, plain):
    params = [greedy(num_assistant_tokens=k) for k in (0, 1, 3, 6, 2, 5)]
    assert ids(mtp_llm.generate(PROMPTS * 2, params)) == ids(plain.generate(PROMPTS * 2, greedy()))
    unbounded = SamplingParams(temperature=0, num_assistant_tokens=4)
    out = mtp_llm.generate(PROMPTS[0], unbounded)[0]
    assert out.outputs[0].token_ids == plain.generate(PROMPTS[0], SamplingParams(temperature=0))[0].outputs[0].token_ids
    assert out.outputs[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("model", ["trained", "accurate"])
def test_prefix_cache_hit_equals_miss(request, model):
    """Same outputs, acceptance and drafts whether the prompt's blocks come from the prefix cache or not,
    including a prompt that shares only a prefix (the MTP layers read one slot back across the block edge)."""
    mtp_target = request.getfixturevalue(model)
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0][:40] + " the lazy dog", PROMPTS[0] + PROMPTS[2]]
    results = {}
    for caching in (False, True):
        llm = LLM(str(mtp_target), kv_cache_memory_gb=0.01, block_size=4, enable_prefix_caching=caching)
        seen = record_drafts(llm)
        cached = []
        for p in prompts:   # one at a time, so the later ones can hit the earlier ones' blocks
            seq = llm.engine.add_request(llm.tokenizer.encode(p), greedy(30, num_assistant_tokens=3))
            while llm.engine.has_unfinished():
                llm.engine.step()
            cached.append(seq.num_cached_tokens)
            results.setdefault(caching, []).append((seq.output_token_ids, seq.spec.to_dict()))
        assert (min(cached[1:]) > 0) == caching
        results[caching].append(seen)
    assert results[True] == results[False]
    assert model == "trained" or sum(spec["num_accepted_tokens"] for _, spec in results[True][:-1]) > 0


def test_layers_restart_past_blocks_cached_without_them(accurate, plain):
    llm = LLM(str(accurate), kv_cache_memory_gb=0.01, block_size=4)
    check_hits_past_the_drafters_blocks(llm, plain, PROMPTS[:2], restarts=True)


@pytest.fixture(scope="module")
def trained_plain_60(trained):
    """Plain decoding of PROMPTS * 2 over 60 tokens by the trained target, shared by both settings below."""
    plain = LLM(str(trained), kv_cache_memory_gb=0.01, speculative_method="none")
    return ids(plain.generate(PROMPTS * 2, greedy(60)))


@pytest.mark.parametrize("settings", [dict(max_num_batched_tokens=7), dict(kv_cache_memory_gb=0.0002, block_size=4)])
def test_chunked_prefill_and_preemption(trained, trained_plain_60, settings):
    """Prompt chunks and preempted sequences (recomputed, partly from the prefix cache) keep the MTP
    caches exact: the output is plain decoding's and the drafts are the cache-free ones."""
    prompts = PROMPTS * 2
    llm = LLM(str(trained), **({"kv_cache_memory_gb": 0.01} | settings))
    preempt, preempted = llm.engine.scheduler.preempt, []
    llm.engine.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    seen = record_drafts(llm)
    assert ids(llm.generate(prompts, greedy(60, num_assistant_tokens=4))) == trained_plain_60
    assert bool(preempted) == ("block_size" in settings)
    mtp, target = llm.engine.proposer.mtp, llm.engine.model
    for tokens, draft in seen[::7]:
        assert draft == reference_draft(mtp, target, tokens, len(draft))


def test_sampled_output_has_the_target_distribution(accurate):
    assert_second_token_is_the_targets(LLM(str(accurate), kv_cache_memory_gb=0.05, max_num_seqs=256), 2000)


def test_layers_in_a_separate_folder(accurate, tmp_path):
    """The shipped demo layout: the target's checkpoint untouched, the layers in a subfolder."""
    target_dir = tmp_path / "t"
    shutil.copytree(accurate, target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (target_dir / "config.json").write_text(json.dumps(config))
    target = load_model(target_dir)
    save_mtp_folder(load_mtp(accurate, target.config), target_dir, target_dir / "mtp", torch.float32)
    assert drafter_kind(target_dir / "mtp") == "mtp"
    for method in (None, "mtp"):
        llm = LLM(str(target_dir), kv_cache_memory_gb=0.01, speculative_method=method)
        assert llm.engine.spec_method == "mtp"
        out = llm.generate(PROMPTS[1], greedy(num_assistant_tokens=3))[0]
        assert out.spec["num_accepted_tokens"] > 0
