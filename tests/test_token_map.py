"""Token maps (drafting/token_map.py): a draft model or MTP layers score only the mapped tokens. Drafts stay
inside the map, greedy output equals plain, sampled output keeps the target's distribution, and bad maps
or flags are refused with their name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from specserve.config import demo_model_dir
from specserve.drafting.token_map import TOKEN_MAP_FILE, ReducedHead, find_token_map, read_token_map
from specserve.llm import LLM
from specserve.models.config import ModelConfig
from specserve.structured_output import GrammarCompiler, StructuredOutput
from specserve.tokenizer import Tokenizer

from stats import assert_second_token_is_the_targets
from test_mtp import accurate, record_drafts  # noqa: F401  (accurate is a fixture)
from test_spec import PROMPTS, damped_pair, greedy, ids  # noqa: F401  (damped_pair is a fixture)

VOCAB = 400      # make_checkpoint's
DEMO = demo_model_dir()


def half_map(tmp_path, seed: int = 0) -> tuple[str, set[int]]:
    """A map of a random half of the vocabulary, as a file."""
    mapped = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:VOCAB // 2].tolist())
    path = tmp_path / "map.json"
    path.write_text(json.dumps(mapped))
    return str(path), set(mapped)


def test_reading_a_map_checks_its_ids(tmp_path):
    (tmp_path / "ok.json").write_text("[5, 3, 3, 9]")
    assert read_token_map(tmp_path / "ok.json", 10).tolist() == [3, 5, 9]
    torch.save(torch.tensor([7, 1]), tmp_path / "sglang.pt")          # SGLang's --speculative-token-map format
    assert read_token_map(tmp_path / "sglang.pt", 10).tolist() == [1, 7]
    for name, text, match in [("far.json", "[1, 10]", r"\[0, 10\)"), ("empty.json", "[]", "0 entries"),
                              ("words.json", '{"a": 1}', "not a list"), ("broken.json", "[1,", "not a list")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            read_token_map(tmp_path / name, 10)
    with pytest.raises(ValueError, match="does not exist"):
        read_token_map(tmp_path / "missing.json", 10)
    (tmp_path / TOKEN_MAP_FILE).write_text("[2]")
    assert find_token_map(None, tmp_path, 10).tolist() == [2]           # the folder's own
    assert find_token_map("none", tmp_path, 10) is None
    assert find_token_map(str(tmp_path / "ok.json"), tmp_path, 10).tolist() == [3, 5, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduced_head_scores_the_mapped_rows_only(dtype):
    weight, hidden = torch.randn(50, 8).to(dtype), torch.randn(3, 8).to(dtype)
    ids = torch.tensor([0, 7, 8, 31, 49])
    logits = ReducedHead(weight, ids, 60, dtype)(hidden)                # a target vocabulary larger than the head's
    assert logits.shape == (3, 60) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[:, ids], (hidden @ weight[ids].T).float(), atol=2e-2, rtol=1e-2)
    outside = torch.ones(60, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[:, outside]).all()


@pytest.fixture(scope="module")
def mapped(damped_pair, tmp_path_factory):
    path, tokens = half_map(tmp_path_factory.mktemp("map"))
    return path, tokens


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_greedy_with_a_token_map_equals_plain_and_drafts_stay_inside(damped_pair, accurate, mapped, method):
    target = str(damped_pair if method == "draft" else accurate)
    plain = LLM(target, kv_cache_memory_gb=0.01, speculative_method="none")
    llm = LLM(target, kv_cache_memory_gb=0.01, speculative_method=method, speculative_token_map=mapped[0])
    assert llm.engine.proposer.head if method == "draft" else llm.engine.proposer.heads[0]
    seen = record_drafts(llm)
    for k in (1, 4):
        outs = llm.generate(PROMPTS, greedy(num_assistant_tokens=k))
        assert ids(outs) == ids(plain.generate(PROMPTS, greedy()))
        assert sum(o.spec["num_accepted_tokens"] for o in outs) > 0
    drafted = {t for _, draft in seen for t in draft}
    assert drafted and drafted <= mapped[1]


def test_the_drafter_folders_map_is_used_and_none_turns_it_off(damped_pair, tmp_path):
    target = tmp_path / "t"
    shutil.copytree(damped_pair, target)
    (target / "draft" / TOKEN_MAP_FILE).write_text(json.dumps(list(range(0, VOCAB, 3))))
    assert LLM(str(target), kv_cache_memory_gb=0.01, speculative_method="draft").engine.proposer.head.size == 134
    off = LLM(str(target), kv_cache_memory_gb=0.01, speculative_method="draft", speculative_token_map="none")
    assert off.engine.proposer.head is None


def test_sampled_output_with_a_token_map_has_the_target_distribution(damped_pair, tmp_path):
    """q is the draft's distribution renormalised over the map (0 outside it): verification with that q keeps
    token 2's marginal the target's, with mapped and unmapped target tokens both likely."""
    path, _ = half_map(tmp_path, seed=1)
    llm = LLM(str(damped_pair), kv_cache_memory_gb=0.05, speculative_method="draft", speculative_token_map=path,
              max_num_seqs=256)
    assert_second_token_is_the_targets(llm, 3000)


def test_a_token_map_is_refused_where_it_cannot_apply(damped_pair, tmp_path):
    path, _ = half_map(tmp_path)
    for method in ("ngram", "none"):
        with pytest.raises(ValueError, match="--speculative-token-map applies to the draft and mtp methods"):
            LLM(str(damped_pair), kv_cache_memory_gb=0.01, speculative_method=method, speculative_token_map=path)
    (tmp_path / "far.json").write_text(f"[1, {VOCAB}]")
    with pytest.raises(ValueError, match="far.json must list token ids"):
        LLM(str(damped_pair), kv_cache_memory_gb=0.01, speculative_method="draft",
            speculative_token_map=str(tmp_path / "far.json"))


def test_a_map_without_a_token_the_grammar_allows_stops_the_draft(tmp_path):
    """Drafting under a grammar over a map that holds none of the tokens it allows first: the first draft is
    empty rather than a token the grammar forbids, and the output is plain decoding's."""
    choice = StructuredOutput(choice=("def fibonacci", "class Stack", "import os"))
    tokenizer = Tokenizer.from_pretrained(DEMO)
    V = ModelConfig.from_pretrained(DEMO).vocab_size
    params = greedy(20, num_assistant_tokens=4)
    params.structured = choice
    expected = ids(LLM(str(DEMO), speculative_method="none").generate(["The code:"], params))
    # the first draft follows the first token, which the prefill's target forward chose
    allowed = GrammarCompiler(tokenizer, V).matcher(choice).allowed([expected[0][:1]])[0][:V]
    path = tmp_path / "map.json"
    path.write_text(json.dumps((~allowed).nonzero().flatten().tolist()))
    llm = LLM(str(DEMO), speculative_method="draft", speculative_token_map=str(path))
    seen = record_drafts(llm)
    assert ids(llm.generate(["The code:"], params)) == expected
    assert seen[0][1] == [] and len(seen[0][0]) == len(llm.tokenizer.encode("The code:")) + 1
