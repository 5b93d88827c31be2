"""Drafting options are declared by their method (drafting/options.py): request fields, flags, defaults."""
import pytest

from specserve.cli_args import add_engine_arguments, engine_config_from_args
from specserve.drafting.factory import all_options, method_options, options_by_method
from specserve.drafting.options import NUM_ASSISTANT_TOKENS, canonical, reject_foreign, resolve_options
from specserve.server.protocol import CompletionRequest


def test_each_method_declares_its_own_options():
    assert method_options("none") == ()
    assert [o.name for o in method_options("ngram")] == ["num_assistant_tokens", "prompt_lookup_min", "prompt_lookup_max"]
    assert [o.name for o in method_options("eagle3")] == ["num_assistant_tokens", "branching_factor", "tree_depth",
                                                           "assistant_confidence_threshold"]
    assert [o.name for o in method_options("draft")] == [o.name for o in method_options("mtp")] == \
        ["num_assistant_tokens", "assistant_confidence_threshold"]
    assert len({o.name for o in all_options()}) == len(all_options())


def test_canonical_takes_aliases_and_checks_bounds():
    assert canonical({"max_ngram_size": 3}, all_options()) == {"prompt_lookup_max": 3}
    # the option's own spelling wins over its alias
    assert canonical({"max_ngram_size": 3, "prompt_lookup_max": 5}, all_options()) == {"prompt_lookup_max": 5}
    with pytest.raises(ValueError, match="tree_depth must be >= 0, got -1 in here"):
        canonical({"tree_depth": -1}, all_options(), " in here")
    with pytest.raises(ValueError, match="num_assistant_tokens must be in \\[0, 32\\], got 33"):
        canonical({"num_assistant_tokens": 33}, all_options())
    assert canonical({"num_assistant_tokens": "auto", "assistant_confidence_threshold": 1}, all_options()) == \
        {"num_assistant_tokens": "auto", "assistant_confidence_threshold": 1.0}
    with pytest.raises(ValueError, match='must be an integer or "auto"'):
        canonical({"num_assistant_tokens": "many"}, all_options())
    with pytest.raises(ValueError, match="must be an integer"):
        canonical({"branching_factor": True}, all_options())
    with pytest.raises(ValueError, match="unknown drafting option 'depth'"):
        canonical({"depth": 2}, all_options())


def test_another_methods_option_is_an_error_only_when_it_asks_for_something():
    every = options_by_method()
    reject_foreign({"tree_depth": 0, "prompt_lookup_min": 3}, "eagle3", every)   # ngram's: no off value, ignored
    reject_foreign({"tree_depth": 0}, "ngram", every)
    for method in ("none", "ngram", "draft", "mtp"):
        with pytest.raises(ValueError, match=f"tree_depth=2 needs a drafting method that has it \\(eagle3\\); "
                                             f"this server drafts with '{method}'"):
            reject_foreign({"tree_depth": 2}, method, every)


def test_resolve_fills_from_the_engine_wide_values():
    own = method_options("eagle3")[1:3]
    assert resolve_options({"tree_depth": 3}, own, {"branching_factor": 4, "tree_depth": 0}) == \
        {"branching_factor": 4, "tree_depth": 3}


def test_flags_and_request_fields_come_from_the_options():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--max-ngram-size", "6", "--tree-depth", "2", "--num-assistant-tokens", "4"])
    assert (args.prompt_lookup_max, args.tree_depth, args.num_assistant_tokens) == (6, 2, 4)
    args = parser.parse_args(["--num-assistant-tokens", "auto", "--assistant-confidence-threshold", "0.4"])
    assert (args.num_assistant_tokens, args.assistant_confidence_threshold) == ("auto", 0.4)
    with pytest.raises(SystemExit):
        parser.parse_args(["--branching-factor", "0"])
    body = CompletionRequest.model_validate({"prompt": "a", "max_ngram_size": 3, "tree_depth": 1.0,
                                             "num_assistant_tokens": 2})
    assert body.draft_options() == {"max_ngram_size": 3, "tree_depth": 1}
    assert body.num_assistant_tokens == 2
    schema = CompletionRequest.model_json_schema()["properties"]
    assert all(o.name in schema for o in all_options()) and NUM_ASSISTANT_TOKENS.name in schema


def test_the_engine_resolves_and_checks_a_requests_options():
    from specserve.config import demo_model_dir
    from specserve.engine.llm_engine import RequestError
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    llm = LLM(str(demo_model_dir()), speculative_method="ngram", prompt_lookup_max=6, kv_cache_memory_gb=0.01)
    engine = llm.engine
    assert engine.draft_defaults == {"num_assistant_tokens": "auto", "prompt_lookup_min": 2, "prompt_lookup_max": 6}
    seq = engine.add_request([5, 6, 7], SamplingParams(draft_options={"prompt_lookup_min": 3}))
    assert seq.params.draft_options == {"prompt_lookup_min": 3, "prompt_lookup_max": 6}
    assert seq.params.num_assistant_tokens == "auto" and seq.num_assistant_tokens == 8     # the longest auto draft
    with pytest.raises(RequestError, match="prompt_lookup_max must be >= prompt_lookup_min \\(7\\), got 6"):
        engine.add_request([5, 6], SamplingParams(draft_options={"prompt_lookup_min": 7}))
    with pytest.raises(RequestError, match="tree_depth=1 needs a drafting method that has it"):
        engine.add_request([5, 6], SamplingParams(draft_options={"tree_depth": 1}))
    with pytest.raises(RequestError, match="unknown drafting option 'depth'"):
        engine.add_request([5, 6], SamplingParams.from_dict({"depth": 1}))
    with pytest.raises(ValueError, match="tree_depth=2 needs a drafting method"):
        LLM(str(demo_model_dir()), speculative_method="ngram", tree_depth=2, kv_cache_memory_gb=0.01)
