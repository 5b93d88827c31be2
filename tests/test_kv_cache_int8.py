"""`--kv-cache-dtype int8`: the target's K/V as int8 with a scale per token and head (layers/attention.py). Greedy
speculative output equals greedy plain output over the same int8 cache for every method and tree drafting, with
the native kernel and without it; logits stay close to those over a bf16 cache; the cache holds about twice the
tokens in the same memory."""
from pathlib import Path

import pytest
import torch

import specserve
from specserve.config import EngineConfig
from specserve.layers.kernels import attend_row_library
from specserve.llm import LLM
from specserve.runtime.model_runner import ForwardItem, kv_cache_bytes_per_token
from specserve.sampling_params import SamplingParams

DEMO = Path(specserve.__file__).parent / "demo_model"
PROMPTS = ["To be, or not to be, that is the question:", "Shall I compare thee to a summer's day?",
           "def fibonacci(n):\n    if n < 2:\n        return n\n"]


def greedy(llm: LLM, k, **options) -> list[list[int]]:
    params = SamplingParams.from_dict(dict(temperature=0, max_tokens=32, ignore_eos=True, num_assistant_tokens=k,
                                           **options))
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("native", [True, False])
def test_greedy_speculation_over_an_int8_cache_equals_plain(native, monkeypatch):
    if native and attend_row_library() is None:
        pytest.skip("no native attention kernel on this CPU")
    if not native:                                   # torch's attention over the dequantized context
        monkeypatch.setenv("SPECSERVE_NATIVE_KERNELS", "0")
        attend_row_library.cache_clear()
    try:
        llm = LLM(str(DEMO), speculative_method="eagle3", kv_cache_dtype="int8", kv_cache_memory_gb=0.05)
        assert llm.engine.runner.kv_cache.dtype == torch.int8 and llm.engine.runner.native_rows == native
        plain = greedy(llm, 0)
        for k, options in ((3, {}), (6, {"branching_factor": 2, "tree_depth": 2}), ("auto", {})):
            out = greedy(llm, k, **options)
            assert out == plain, (k, options)
        assert llm.engine.stats.num_drafts > 0
        ngram = LLM(str(DEMO), speculative_method="ngram", kv_cache_dtype="int8", kv_cache_memory_gb=0.05)
        assert greedy(ngram, 4) == plain
    finally:
        attend_row_library.cache_clear()


def test_logits_over_an_int8_cache_stay_close_to_bf16():
    """A 600-token context, then the logits of 8 decode-shaped rows: the int8 cache's error is a few percent of
    the largest logit, and the top token agrees almost everywhere."""
    logits = {}
    for kind in ("auto", "int8"):
        llm = LLM(str(DEMO), speculative_method="none", kv_cache_dtype=kind, kv_cache_memory_gb=0.05)
        runner, model = llm.engine.runner, llm.engine.model
        ids = llm.engine.tokenizer.encode(" ".join(PROMPTS) * 30)[:608]
        table = list(range(-(-len(ids) // runner.block_size)))
        runner.forward([ForwardItem(table, 0, ids[:600])])
        hidden, _ = runner.forward([ForwardItem(table, 600, ids[600:])])
        logits[kind] = model.compute_logits(hidden).float()
    ref, got = logits["auto"], logits["int8"]
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


def test_an_int8_cache_holds_about_twice_the_tokens():
    bf16 = kv_cache_bytes_per_token(30, 3, 64, torch.bfloat16, "cpu")
    int8 = kv_cache_bytes_per_token(30, 3, 64, torch.bfloat16, "cpu", "int8")
    assert int8 == 2 * 30 * 3 * (64 + 4) and int8 <= 0.55 * bf16      # a bf16 cache (fp32 on an AVX2-only CPU)
    blocks = {kind: LLM(str(DEMO), speculative_method="none", kv_cache_dtype=kind,
                        kv_cache_memory_gb=0.02).engine.block_manager.num_blocks for kind in ("auto", "int8")}
    assert blocks["int8"] >= 1.8 * blocks["auto"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=str(DEMO), kv_cache_dtype="fp8")
