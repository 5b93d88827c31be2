"""EAGLE3: the published head format, layer resolution, chain and tree drafting, exactness, training.

The target is a tiny Qwen3 trained for a few seconds on the conftest text, so that its greedy
continuations are predictable and a head trained by `specserve train eagle3` gets both accepted and
rejected tokens."""
import json
import logging
import shutil

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from specserve.cli import main as cli_main
from specserve.runtime.model_runner import ForwardItem, ModelRunner
from specserve.engine.llm_engine import RequestError
from specserve.llm import LLM
from specserve.models.eagle3 import resolve_aux_layers
from specserve.models.llama import PACKED
from specserve.models.loader import save_safetensors, unpacked_state_dict
from specserve.models.registry import load_model
from specserve.sampling_params import SamplingParams
from specserve.drafting.tree import GrowingTree
from specserve.drafting.factory import drafter_kind
from specserve.tokenizer import Tokenizer
from specserve.train.demo import next_token_loss
from specserve.train.trainer import StageConfig, train_stage

from conftest import TEXT, make_checkpoint, make_drafts_free
from test_spec import PROMPTS, check_hits_past_the_drafters_blocks, greedy, ids

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype")

LAYERS = 8
CHAIN_SETTINGS = [1, 2, 5, 8]
TREE_SETTINGS = [(2, 2, 4), (2, 3, 6), (3, 2, 9), (4, 3, 12), (8, 2, 8)]    # (branching_factor, tree_depth, k)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny 8-layer target trained on TEXT, with a head trained by `specserve train eagle3` in target/eagle3."""
    root = tmp_path_factory.mktemp("eagle3")
    path = make_checkpoint(root / "target", "qwen3", layers=LAYERS, seed=3)
    model = load_model(path, torch.float32).requires_grad_(True)
    tokens = torch.tensor(Tokenizer.from_pretrained(path).encode(TEXT))
    stage = StageConfig("target", 1.0, max_steps=60, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=10)
    train_stage(stage, model, lambda batch: next_token_loss(model, batch), tokens, root / "target.pt", False)
    save_safetensors(unpacked_state_dict(model, PACKED), path / "model.safetensors")
    (root / "corpus.txt").write_text(TEXT)
    assert cli_main(["train", "eagle3", "--target", str(path), "--corpus", str(root / "corpus.txt"), "--max-steps", "25",
                     "--batch-size", "4", "--seq-len", "64", "--ttt-steps", "3", "--draft-vocab-size", "200",
                     "--vocab-tokens", "2000", "--lr", "3e-3", "--dtype", "float32"]) == 0
    return path


@pytest.fixture(scope="module")
def plain(target):
    return LLM(str(target), kv_cache_memory_gb=0.01, speculative_method="none")


@pytest.fixture(scope="module")
def eagle(target):
    return LLM(str(target), kv_cache_memory_gb=0.05, speculative_method="eagle3", max_num_seqs=256)


# ---- format and start-up ------------------------------------------------------------------------
def test_layer_resolution():
    assert resolve_aux_layers(None, 36) == (2, 18, 33)              # EAGLE3's default, capture-before
    assert resolve_aux_layers([1, 17, 32], 36) == (2, 18, 33)       # SpecForge writes layer outputs
    assert resolve_aux_layers([2, 18, 33], 36) == (2, 18, 33)       # capture-before ids taken as they are
    assert resolve_aux_layers([3, 10, 20], 36) == (3, 10, 20)
    with pytest.raises(ValueError, match="target has 8 layers"):
        resolve_aux_layers([2, 4, 12], 8)


def test_train_layers_option_takes_capture_before_ids():
    import argparse
    from specserve.train.eagle3 import parse_layers
    assert parse_layers("2,5,8") == (2, 5, 8)
    with pytest.raises(argparse.ArgumentTypeError, match="first >= 2"):
        parse_layers("1,4,7")                                        # would read as layer outputs


def test_trained_head_is_saved_in_the_published_layout(target):
    head = target / "eagle3"
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 200
    weights = load_file(head / "model.safetensors")
    H = config["hidden_size"]
    assert weights["fc.weight"].shape == (H, 3 * H)
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert weights["lm_head.weight"].shape == (200, H)
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert int(weights["t2d"].sum()) == 200
    draft_to_target = torch.arange(200) + weights["d2t"]
    assert torch.equal(weights["t2d"].nonzero().squeeze(1), draft_to_target)
    assert "embed_tokens.weight" not in weights
    assert drafter_kind(head) == "eagle3"
    summary = json.loads((head / "training_summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"]


def test_train_continues_a_saved_head(target, tmp_path):
    out = tmp_path / "continued"
    assert cli_main(["train", "eagle3", "--target", str(target), "--init", str(target / "eagle3"), "--out", str(out),
                     "--corpus", str(target.parent / "corpus.txt"), "--max-steps", "2", "--batch-size", "2",
                     "--seq-len", "32", "--ttt-steps", "2", "--dtype", "float32"]) == 0
    before, after = load_file(target / "eagle3" / "model.safetensors"), load_file(out / "model.safetensors")
    assert torch.equal(before["d2t"], after["d2t"]) and not torch.equal(before["fc.weight"], after["fc.weight"])
    assert json.loads((out / "training_summary.json").read_text())["continued_from"]["steps"] == 25


def reference_head(w: dict, config: dict, embed: torch.Tensor, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The published EAGLE3 head written from its description, cache-free, for one sequence:
    states [T, 3H] of target positions 0..T-1, tokens [T] = the tokens at positions 1..T.
    Returns target token ids of the argmax draft at each position."""
    eps, nh, nkv, hd = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    rms = lambda x, name: F.rms_norm(x, (x.shape[-1],), w[name], eps)
    T = len(tokens)
    hidden = states @ w["fc.weight"].T
    x = torch.cat([rms(embed[tokens], "midlayer.input_layernorm.weight"), rms(hidden, "midlayer.hidden_norm.weight")], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, nh, hd)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, hd)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, hd)
    inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    angle = torch.arange(T)[:, None].float() * inv[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    rot = lambda t: t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin
    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    h = hidden + att.transpose(0, 1).reshape(T, nh * hd) @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(h, "midlayer.post_attention_layernorm.weight")
    h = h + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
    draft = (rms(h, "norm.weight") @ w["lm_head.weight"].T).argmax(-1)
    return draft + w["d2t"][draft]


@pytest.fixture(scope="module")
def published_head(target, tmp_path_factory):
    """A random head written tensor by tensor in the published layout (separate q/k/v and gate/up,
    d2t to a scattered draft vocabulary, t2d, SpecForge-style layer ids, no embed_tokens)."""
    out = tmp_path_factory.mktemp("published") / "head"
    out.mkdir()
    t = json.loads((target / "config.json").read_text())
    H, I, nh, nkv, hd, V, Vd = t["hidden_size"], 96, 4, 2, 16, t["vocab_size"], 64
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2
    draft_to_target = torch.randperm(V, generator=g)[:Vd].sort().values
    w = {"fc.weight": r(H, 3 * H), "midlayer.self_attn.q_proj.weight": r(nh * hd, 2 * H),
         "midlayer.self_attn.k_proj.weight": r(nkv * hd, 2 * H), "midlayer.self_attn.v_proj.weight": r(nkv * hd, 2 * H),
         "midlayer.self_attn.o_proj.weight": r(H, nh * hd), "midlayer.mlp.gate_proj.weight": r(I, H),
         "midlayer.mlp.up_proj.weight": r(I, H), "midlayer.mlp.down_proj.weight": r(H, I),
         "midlayer.input_layernorm.weight": 1 + r(H), "midlayer.hidden_norm.weight": 1 + r(H),
         "midlayer.post_attention_layernorm.weight": 1 + r(H), "norm.weight": 1 + r(H), "lm_head.weight": r(Vd, H),
         "d2t": draft_to_target - torch.arange(Vd), "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, draft_to_target, True)}
    save_file(w, out / "model.safetensors")
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
              "num_hidden_layers": 1, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024, "vocab_size": V,
              "draft_vocab_size": Vd, "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, LAYERS // 2 - 1, LAYERS - 4]}}
    (out / "config.json").write_text(json.dumps(config))
    return out, w, config


def test_published_head_loads_and_drafts_exactly_as_written(target, published_head, plain):
    path, w, config = published_head
    llm = LLM(str(target), kv_cache_memory_gb=0.01, draft_model=str(path))
    proposer = llm.engine.proposer
    assert llm.engine.spec_method == "eagle3" and proposer.layers == (2, 4, 5)
    # the head's argmax drafts over a prompt equal the reference implementation's
    prompt = llm.tokenizer.encode(PROMPTS[0])
    T = len(prompt)
    model = llm.engine.model
    _, aux = model(torch.tensor([prompt]), torch.arange(T), None, (2, 4, 5))
    states = torch.cat([a[0, :-1] for a in aux], -1)
    expected = reference_head(w, config, model.model.embed_tokens.weight, states, torch.tensor(prompt[1:]))
    head = proposer.head
    out = head(torch.tensor([prompt[1:]]), head.fc(states)[None], torch.arange(T - 1))
    assert torch.equal(head.target_ids(head.draft_logits(out[0]).argmax(-1)), expected)
    assert set(expected.tolist()) <= set((torch.arange(64) + w["d2t"]).tolist())
    # and it drafts through the engine, in the draft vocabulary, exactly
    outs = llm.generate(PROMPTS, greedy(30, num_assistant_tokens=3))
    assert ids(outs) == ids(plain.generate(PROMPTS, greedy(30)))
    assert all(o.spec["num_drafts"] > 0 for o in outs)


def test_published_head_with_its_own_embedding_as_pytorch_bin(target, published_head, tmp_path):
    """The EAGLE reference ships pytorch_model.bin, some heads carry their own embed_tokens."""
    path, w, config = published_head
    own = tmp_path / "bin"
    own.mkdir()
    embed = torch.randn(config["vocab_size"], config["hidden_size"], generator=torch.Generator().manual_seed(1))
    torch.save({**w, "embed_tokens.weight": embed}, own / "pytorch_model.bin")
    (own / "config.json").write_text(json.dumps(config))
    llm = LLM(str(target), kv_cache_memory_gb=0.01, draft_model=str(own))
    head, model = llm.engine.proposer.head, llm.engine.model
    assert head.embed_tokens is not model.model.embed_tokens
    prompt = llm.tokenizer.encode(PROMPTS[2])
    T = len(prompt)
    _, aux = model(torch.tensor([prompt]), torch.arange(T), None, (2, 4, 5))
    states = torch.cat([a[0, :-1] for a in aux], -1)
    out = head(torch.tensor([prompt[1:]]), head.fc(states)[None], torch.arange(T - 1))
    expected = reference_head(w, config, embed, states, torch.tensor(prompt[1:]))
    assert torch.equal(head.target_ids(head.draft_logits(out[0]).argmax(-1)), expected)


def test_head_that_does_not_fit_the_target_is_a_startup_error(target, published_head, tmp_path):
    path, _, config = published_head
    for change, message in (({"target_hidden_size": 48}, "hidden states of size 48"),
                            ({"vocab_size": 999}, "vocab_size is 999"),
                            ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 11]}}, "target has 8 layers")):
        bad = tmp_path / f"bad{len(message)}"
        shutil.copytree(path, bad)
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            LLM(str(target), kv_cache_memory_gb=0.01, draft_model=str(bad))


def test_startup_logs_layers_and_warns_about_a_head_that_never_agrees(target, published_head, caplog):
    with caplog.at_level(logging.INFO, logger="specserve.drafting.eagle3"):
        LLM(str(target), kv_cache_memory_gb=0.01, draft_model=str(published_head[0]))
    assert "entering layers [2, 4, 5]" in caplog.text
    assert "near zero" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specserve.drafting.eagle3"):
        LLM(str(target), kv_cache_memory_gb=0.01, speculative_method="eagle3")
    assert "near zero" not in caplog.text


def test_head_in_the_model_folder_is_detected(target, eagle):
    assert eagle.engine.spec_method == "eagle3"
    assert LLM(str(target), kv_cache_memory_gb=0.01).engine.spec_method == "eagle3"


# ---- trees ---------------------------------------------------------------------------------------
def test_growing_tree_expands_the_best_nodes_and_keeps_a_connected_subtree():
    tree = GrowingTree(branching=2, depth=3)
    tree.add_children(-1, [10, 11, 12], [-0.1, -1.0, -3.0], level=1)      # only the top 2 are taken
    assert tree.tokens == [10, 11] and tree.parents == [-1, -1]
    assert tree.to_expand(1) == [0, 1]
    tree.add_children(0, [20, 21], [-0.2, -2.0], level=2)                 # scores -0.3, -2.1
    tree.add_children(1, [22, 23], [-0.1, -0.5], level=2)                 # scores -1.1, -1.5
    assert tree.to_expand(2) == [2, 4]
    tree.add_children(2, [30, 31], [-0.1, -0.1], level=3)                 # -0.4, -0.4: a tie goes to the earlier
    tree.add_children(4, [32, 33], [-0.01, -5.0], level=3)                # -1.11, -6.1
    tokens, parents = tree.select(5)                                      # scores: 0:-.1 2:-.3 6:-.4 7:-.4 1:-1
    assert tokens == [10, 11, 20, 30, 31] and parents == [-1, -1, 0, 2, 2]
    tokens, parents = tree.select(7)                                      # + 4:-1.1 8:-1.11, its child
    assert tokens == [10, 11, 20, 22, 30, 31, 32] and parents == [-1, -1, 0, 1, 2, 2, 3]
    assert GrowingTree(1, 4).to_expand(1) == []


@pytest.mark.parametrize("root_at_catch_up", [True, False])
def test_tree_nodes_see_only_their_ancestors(eagle, root_at_catch_up):
    """Every drafted node's head output equals a cache-free run of the head over the committed context
    followed by the node's own root-to-node path (the tree mask and depth positions at work). The
    root (the last token's slot) comes from the catch-up forward, or from its own forward when the
    slot was not in the block table then."""
    engine = eagle.engine
    proposer = engine.proposer
    seq = engine.add_request(eagle.tokenizer.encode(PROMPTS[1]), greedy(12, num_assistant_tokens=0))
    while seq.num_output_tokens < 5 or seq.num_computed_tokens % 16 == 0:     # the last token's slot exists
        engine.step()
    state = proposer.states[seq.seq_id]
    assert state.num_pending                # not drafting: the head has not run over its latest tokens
    proposer._catch_up([(seq, state)])      # as propose() does first
    assert state.root is not None and not state.pending and state.num_computed == seq.num_computed_tokens
    if not root_at_catch_up:
        proposer.states[seq.seq_id].root = None
    trees = {0: GrowingTree(3, 3)}
    proposer._grow([seq], trees)
    tree = trees[0]
    assert len(tree.fed) == 3 + 3
    n = seq.num_computed_tokens
    model, head = engine.model, proposer.head
    _, aux = model(torch.tensor([seq.token_ids[:n]]), torch.arange(n), None, proposer.aux_layers)
    states = torch.cat([aux[j][0] for j in proposer.aux_order], -1)
    context_hidden = head.fc(states)                                         # [n, H]
    for node in tree.fed:
        path = [node]
        while tree.parents[path[0]] >= 0:
            path.insert(0, tree.parents[path[0]])
        node_hidden = [tree.root_output] + [tree.outputs[j] for j in path[:-1]]
        hidden = torch.cat([context_hidden, torch.stack(node_hidden)])
        tokens = seq.token_ids[1:n + 1] + [tree.tokens[j] for j in path]
        out = head(torch.tensor([tokens]), hidden[None], torch.arange(len(tokens)))
        assert torch.allclose(out[0, -1], tree.outputs[node], atol=1e-5)
    engine.abort(seq.request_id)
    while engine.has_unfinished():
        engine.step()


def assert_head_cache_is_fresh(engine, seq) -> None:
    """Head slots [s, d) hold what a fresh cache-free run over the committed tokens from slot s writes (s = 1, or
    where a windowed catch-up restarted the head: it attends nothing before)."""
    proposer, head = engine.proposer, engine.proposer.head
    d, s = seq.num_drafter_computed, max(1, seq.drafter_start)
    assert d == seq.num_computed_tokens
    _, aux = engine.model(torch.tensor([seq.token_ids[:d]]), torch.arange(d), None, proposer.aux_layers)
    states = torch.cat([aux[j][0] for j in proposer.aux_order], -1)[s - 1:-1]
    c = proposer.config.layer
    fresh = ModelRunner(head, 1, c.num_key_value_heads, c.head_dim, 16, 16, torch.float32)
    input_ids, positions, ctx = fresh.prepare([ForwardItem(list(range(16)), 0, seq.token_ids[s:d], list(range(s - 1, d - 1)))])
    head(input_ids, head.fc(states), positions, ctx)
    slots = torch.from_numpy(proposer.runner.slots(seq.block_table, s, d))
    assert torch.allclose(proposer.runner.kv_cache[:, slots], fresh.kv_cache[:, :d - s], atol=1e-5)


def test_head_cache_after_rejections_and_prefix_hits_equals_a_fresh_run(target):
    llm = LLM(str(target), kv_cache_memory_gb=0.01, speculative_method="eagle3")
    engine = llm.engine
    prompt = llm.tokenizer.encode(TEXT[:200])
    assert len(prompt) > 3 * 16
    params = greedy(40, num_assistant_tokens=4, tree_depth=2, branching_factor=3)
    llm.generate([prompt], params)
    for variant in (prompt[:40] + llm.tokenizer.encode(" Whether 'tis nobler"), prompt):
        seq = engine.add_request(variant, params)
        engine.step()
        assert seq.num_cached_tokens >= 32
        while seq.num_output_tokens < 30:
            engine.step()
        assert seq.spec.num_accepted_tokens < seq.spec.num_draft_tokens, "no rejection to catch up after"
        assert_head_cache_is_fresh(engine, seq)
        engine.abort(seq.request_id)


@pytest.mark.parametrize("window", [0, 8, 40])
@pytest.mark.parametrize("raw_rows", [1, 8, 10 ** 6])
def test_states_held_before_fc_give_the_head_cache_of_a_fresh_run(target, raw_rows, window, monkeypatch):
    """A sequence that drafts nothing keeps the target's states as they are until RAW_ROWS of them wait (fc then
    applies to them), so it holds rows after fc and newer raw ones; the catch-up over them (over the last `window`
    of them, skipping the rest: the skip ends among raw rows, or among fc'd ones) writes what a fresh run over them
    writes, and a later request restarting from its blocks' tails drafts plain decoding's output."""
    monkeypatch.setattr("specserve.drafting.eagle3.RAW_ROWS", raw_rows)
    llm = LLM(str(target), kv_cache_memory_gb=0.01, speculative_method="eagle3", speculative_catch_up_window=window)
    engine, proposer = llm.engine, llm.engine.proposer
    prompt = llm.tokenizer.encode(TEXT[:200])
    seq = engine.add_request(prompt, greedy(30, num_assistant_tokens=0))
    while seq.num_output_tokens < 29:
        engine.step()
    state = proposer.states[seq.seq_id]
    held = {1: 0, 8: (state.num_pending - len(prompt)) % 8, 10 ** 6: state.num_pending}[raw_rows]   # the prompt fed at once
    assert len(prompt) < state.num_pending and state.num_raw == held
    pending, ran = state.num_pending, []
    forward = proposer._forward
    proposer._forward = lambda items, hidden, *a: (ran.append(len(hidden)), forward(items, hidden, *a))[1]
    proposer._catch_up([(seq, state)])
    assert state.num_raw == 0 and not state.raw and not state.pending
    assert ran == [pending if not window else window + 1]        # + the last token's slot (the next root)
    assert seq.drafter_start == (0 if not window else seq.num_computed_tokens - window)
    assert_head_cache_is_fresh(engine, seq)
    while engine.has_unfinished():
        engine.step()
    again = engine.add_request(prompt + llm.tokenizer.encode(" Whether 'tis nobler"), greedy(24, num_assistant_tokens=3))
    while engine.has_unfinished():
        engine.step()
    assert again.num_cached_tokens >= 32 and again.spec.num_draft_tokens > 0
    assert again.output_token_ids == ids(llm.generate([again.token_ids[:again.num_prompt_tokens]], greedy(24)))[0]


def test_head_restarts_past_blocks_cached_without_it(target, plain):
    llm = LLM(str(target), kv_cache_memory_gb=0.01, speculative_method="eagle3", block_size=4)
    check_hits_past_the_drafters_blocks(llm, plain, [TEXT[:120], TEXT[300:420]], restarts=True)


# ---- exactness -----------------------------------------------------------------------------------
def test_chain_greedy_equals_plain(eagle, plain):
    expected = ids(plain.generate(PROMPTS, greedy()))
    lengths = []
    for k in CHAIN_SETTINGS:
        outs = eagle.generate(PROMPTS, greedy(num_assistant_tokens=k))
        assert ids(outs) == expected, f"k={k}"
        lengths.append(np.mean([o.spec["mean_acceptance_length"] for o in outs]))
    assert lengths[-1] > lengths[0] > 1.3
    mixed = eagle.generate(PROMPTS * 2, [greedy(num_assistant_tokens=k) for k in (0, 1, 3, 5, 8, 2)])
    assert ids(mixed) == expected * 2


def test_tree_greedy_equals_plain(eagle, plain):
    expected = ids(plain.generate(PROMPTS, greedy()))
    for b, depth, k in TREE_SETTINGS:
        outs = eagle.generate(PROMPTS, greedy(num_assistant_tokens=k, branching_factor=b, tree_depth=depth))
        assert ids(outs) == expected, f"b={b} depth={depth} k={k}"
        assert all(o.spec["num_accepted_tokens"] > 0 for o in outs)
        assert all(o.spec["mean_acceptance_length"] <= depth + 1 for o in outs)
    single = eagle.generate(PROMPTS[2], greedy(num_assistant_tokens=6, branching_factor=2, tree_depth=3))
    assert ids(single) == expected[2:]


@pytest.mark.parametrize("tree", [None, (3, 2)], ids=["chain", "tree"])
def test_seeded_sampling_equals_plain_sampling(eagle, plain, tree):
    """Deterministic drafts are verified by sampling with per-position uniforms: seeded output equals
    plain seeded sampling token for token, with temperature, top-k and top-p."""
    spec = dict(branching_factor=tree[0], tree_depth=tree[1]) if tree else {}
    for kw in (dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.2, top_p=0.8)):
        params = SamplingParams(max_tokens=30, ignore_eos=True, seed=5, num_assistant_tokens=5, **kw)
        expected = ids(plain.generate(PROMPTS, params))
        params.draft_options = spec
        assert ids(eagle.generate(PROMPTS, params)) == expected


@pytest.mark.parametrize("tree,k", [(None, 3), ((2, 2), 3), (None, "auto")], ids=["chain", "tree", "auto"])
def test_sampled_output_has_the_target_distribution(eagle, tree, k, monkeypatch):
    """Unseeded: the second output token's empirical distribution matches the target's exact marginal."""
    if k == "auto":    # this random head is rarely right: "auto" would rightly draft nothing, unless drafts were free
        make_drafts_free(eagle, monkeypatch)
    prompt = eagle.tokenizer.encode("The quick brown fox jumps over the")
    n = 3000
    spec = dict(branching_factor=tree[0], tree_depth=tree[1]) if tree else {}
    outs = eagle.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True,
                                                       num_assistant_tokens=k, draft_options=spec))
    drafted = sum(o.spec["num_draft_tokens"] for o in outs)
    assert 0 < sum(o.spec["num_accepted_tokens"] for o in outs) < drafted
    model = eagle.engine.model
    V = model.config.vocab_size
    with torch.no_grad():
        final, _ = model(torch.tensor([prompt]), torch.arange(len(prompt)))
        p1 = torch.softmax(model.compute_logits(final[0, -1]).double(), -1)
        batch = torch.tensor([prompt + [t] for t in range(V)])
        final, _ = model(batch, torch.arange(len(prompt) + 1))
        p2 = torch.softmax(model.compute_logits(final[:, -1]).double(), -1)
    marginal = (p1[:, None] * p2).sum(0).numpy()
    expected = marginal / marginal.sum() * n
    counts = np.bincount([o.outputs[0].token_ids[1] for o in outs], minlength=V)
    big = expected >= 5
    assert chisquare(np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())).pvalue > 1e-3


# ---- requests, server and CLI --------------------------------------------------------------------
def test_impossible_tree_is_rejected_naming_the_three_values(eagle):
    with pytest.raises(RequestError, match="branching_factor=2 and tree_depth=2 has 6 nodes, fewer than num_assistant_tokens=7"):
        eagle.engine.add_request([5, 6], SamplingParams(num_assistant_tokens=7, draft_options=dict(branching_factor=2, tree_depth=2)))


def test_server_takes_tree_settings_per_request_and_answers_400_for_an_impossible_tree(target):
    from specserve.config import EngineConfig
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.llm_engine import LLMEngine
    from specserve.server.api_server import build_app
    from test_server import LiveServer
    engine = AsyncEngine(LLMEngine(EngineConfig(model=target, kv_cache_memory_gb=0.01, speculative_method="eagle3")))
    with LiveServer(build_app(engine, "tiny")) as live:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "num_assistant_tokens": 6}
        bad = httpx.post(f"{live.url}/v1/completions", json={**body, "branching_factor": 2, "tree_depth": 1})
        assert bad.status_code == 400
        assert all(s in bad.json()["error"]["message"] for s in ("branching_factor=2", "tree_depth=1", "num_assistant_tokens=6"))
        good = httpx.post(f"{live.url}/v1/completions", json={**body, "branching_factor": 3, "tree_depth": 2})
        assert good.status_code == 200, good.text


def test_generate_cli_drafts_trees(target, plain, capsys):
    assert cli_main(["generate", "--model", str(target), "--prompt", PROMPTS[1], "--max-tokens", "16", "--ignore-eos",
                     "--speculative-method", "eagle3", "--draft-model", str(target / "eagle3"), "--kv-cache-memory-gb", "0.01",
                     "--num-assistant-tokens", "6", "--branching-factor", "2", "--tree-depth", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["speculative_method"] == "eagle3" and out["spec"]["num_accepted_tokens"] > 0
    assert out["token_ids"] == ids(plain.generate(PROMPTS[1], greedy(16)))[0]
