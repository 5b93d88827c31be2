"""The shipped demo models (test fixtures, named explicitly): drafting that keeps greedy output exact."""
import json

import pytest

from specserve.cli import main
from specserve.config import demo_model_dir
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

DEMO = demo_model_dir()
pytestmark = pytest.mark.skipif(not (DEMO / "model.safetensors").exists(), reason="demo model not trained yet")


def generate_json(capsys, *flags) -> dict:
    assert main(["generate", "--model", str(DEMO), "--prompt", "def fibonacci(n):", "--max-tokens", "48", "--json",
                 *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_drafts_with_the_demo_draft_and_matches_plain(capsys):
    plain = generate_json(capsys, "--speculative-method", "none")
    draft = generate_json(capsys, "--speculative-method", "draft")
    assert draft["text"] == plain["text"] and draft["token_ids"] == plain["token_ids"]
    assert draft["speculative_method"] == "draft" and draft["spec"]["num_drafts"] > 0
    assert draft["spec"]["mean_acceptance_length"] > 1.3
    for key in ("num_prompt_tokens", "num_generated_tokens", "tokens_per_second", "ttft_s"):
        assert plain[key] is not None


def test_llm_runs_the_demo_model_named_by_path():
    llm = LLM(str(DEMO), speculative_method="ngram")
    assert llm.engine.config.model == str(DEMO)
    out = llm.chat([{"role": "user", "content": "def add(a, b):"}], SamplingParams(temperature=0, max_tokens=16))
    assert out[0].outputs[0].token_ids
