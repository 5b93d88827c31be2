"""The drafters shipped for the default model (specserve/default_drafters/: an EAGLE3 head, a draft model, MTP
layers, trained by `specserve train data|eagle3|draft|mtp`): found for SmolLM2 from their config.json alone, of
the kind it says, sized for the target; greedy output with each of them, chain and tree, equals plain decoding
(float32: in bf16 equality holds only up to near-ties, see tests/test_gguf_smollm2.py)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from specserve.cli import main
from specserve.config import default_model_dir, demo_model_dir
from specserve.llm import LLM
from specserve.models.config import ModelConfig
from specserve.models.eagle3 import Eagle3Config, check_fits_target, load_eagle3_head, resolve_aux_layers
from specserve.models.mtp import check_compatible, load_mtp
from specserve.models.registry import load_model
from specserve.sampling_params import SamplingParams
from specserve.drafting.factory import default_drafters_dir, drafter_kind, find_drafters, shipped_drafters
from specserve.drafting.token_map import TOKEN_MAP_FILE, read_token_map

KINDS = ("draft", "eagle3", "mtp")
SHIPPED = default_drafters_dir()
pytestmark = pytest.mark.skipif(not all((SHIPPED / k / "model.safetensors").exists() for k in KINDS),
                                reason=f"the shipped drafter weights are absent from {SHIPPED}")
CHATS = [[{"role": "user", "content": "Write a Python function that returns the square of a number."}],
         [{"role": "user", "content": "Continue this text:\n\nShall I compare thee to a summer's day?"}]]
EXACT = dict(kv_cache_memory_gb=0.05, dtype="float32")


@pytest.fixture(scope="module")
def smollm2():
    return default_model_dir()


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = LLM(speculative_method="none", **EXACT)
    return [o.outputs[0].token_ids for o in llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=24))]


def test_shipped_drafters_are_found_for_the_default_model_only(smollm2):
    assert find_drafters(smollm2) == {kind: SHIPPED / kind for kind in KINDS}
    assert {drafter_kind(SHIPPED / kind) for kind in KINDS} == set(KINDS)
    float32 = LLM(speculative_method="none", **EXACT).engine.config.model         # the float32 conversion
    assert find_drafters(float32) == {kind: SHIPPED / kind for kind in KINDS}
    assert shipped_drafters(demo_model_dir()) == [] and "eagle3" in find_drafters(demo_model_dir())


def test_shipped_drafters_fit_the_target(smollm2):
    target = ModelConfig.from_pretrained(smollm2)
    head = Eagle3Config.from_pretrained(SHIPPED / "eagle3")
    check_fits_target(head, target, SHIPPED / "eagle3")
    assert (head.target_hidden_size, head.layer.vocab_size, head.layer.hidden_size) == (576, 49152, 576)
    assert resolve_aux_layers(head.aux_layer_ids, target.num_hidden_layers) == (2, 15, 27)   # low, middle, high
    embed = torch.nn.Embedding(target.vocab_size, target.hidden_size)
    loaded = load_eagle3_head(SHIPPED / "eagle3", embed, target, torch.float32, "cpu", 64)
    mapped = loaded.target_ids(torch.arange(head.draft_vocab_size))
    assert head.draft_vocab_size < target.vocab_size and torch.equal(mapped, mapped.unique())

    draft = ModelConfig.from_pretrained(SHIPPED / "draft")
    assert draft.architectures == ["LlamaForCausalLM"] and draft.vocab_size == target.vocab_size
    assert (draft.bos_token_id, draft.eos_token_id) == (target.bos_token_id, target.eos_token_id)
    assert 2 <= draft.num_hidden_layers <= 4 and draft.hidden_size < target.hidden_size

    mtp_config = ModelConfig.from_pretrained(SHIPPED / "mtp")
    check_compatible(mtp_config, target, SHIPPED / "mtp")
    assert load_mtp(SHIPPED / "mtp", target).num_layers == mtp_config.num_nextn_predict_layers >= 1

    for kind in ("draft", "mtp"):          # their heads score the 8,192 tokens the target predicts most often
        assert len(read_token_map(SHIPPED / kind / TOKEN_MAP_FILE, target.vocab_size)) == 8192

    weights = sum((SHIPPED / kind / "model.safetensors").stat().st_size for kind in KINDS)
    assert weights <= 40e6
    for kind in KINDS:
        summary = json.loads((SHIPPED / kind / "training_summary.json").read_text())
        assert summary["trained_on"]
        minutes = [summary["minutes"]]              # this run and the runs it continued (a resize runs 0 steps)
        while "continued_from" in summary:
            summary = summary["continued_from"]
            minutes.append(summary["minutes"])
        assert sum(minutes) > 0 and summary["answer_tokens"] > 0


def test_transformers_loads_the_draft_model_with_the_same_logits():
    ids = torch.tensor([[1, 4093, 198, 1234, 28, 906, 2]])
    ours = load_model(SHIPPED / "draft", torch.float32)
    with torch.no_grad():
        hidden, _ = ours(ids, torch.arange(ids.shape[1]))
        expected = ours.compute_logits(hidden)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED / "draft", dtype=torch.float32)(ids).logits
    torch.testing.assert_close(theirs, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method,settings", [
    ("eagle3", [dict(num_assistant_tokens=3), dict(num_assistant_tokens=7),
                dict(num_assistant_tokens=6, branching_factor=2, tree_depth=3)]),
    ("draft", [dict(num_assistant_tokens=4)]), ("mtp", [dict(num_assistant_tokens=1), dict(num_assistant_tokens=3)]),
])
def test_greedy_with_each_shipped_drafter_equals_plain(plain, method, settings):
    llm = LLM(speculative_method=method, **EXACT)              # no --draft-model: the shipped one is found
    assert llm.engine.spec_method == method
    for setting in settings:                                    # one engine per drafter, each setting on it
        outs = llm.chat(CHATS, SamplingParams.from_dict(dict(temperature=0, max_tokens=24, **setting)))
        assert [o.outputs[0].token_ids for o in outs] == plain, setting
        assert sum(o.spec["num_accepted_tokens"] for o in outs) > 0, setting     # trained: it gets some drafts right


def test_generate_eagle3_reports_acceptance_with_no_extra_flags(capsys):
    assert main(["generate", "--speculative-method", "eagle3", "--prompt", "Write a haiku about the sea.", "--chat",
                 "--max-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speculative_method"] == "eagle3"
    assert out["spec"]["num_drafts"] > 0 and out["spec"]["mean_acceptance_length"] > 1.0
