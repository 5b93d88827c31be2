"""--compile (models/compiled.py): the target's paged forward as torch.compile graphs on CPU. Greedy speculation
stays exact under it, its forward stays close to the eager one, and two compiled models in one process keep
their own graphs."""
import argparse
import functools
from pathlib import Path

import pytest
import torch

import specserve
from specserve.cli import add_generate_parser
from specserve.cli_args import engine_config_from_args
from specserve.config import EngineConfig
from specserve.llm import LLM
from specserve.runtime.model_runner import ForwardItem
from specserve.sampling_params import SamplingParams

DEMO = Path(specserve.__file__).parent / "demo_model"
PROMPTS = ["To be, or not to be, that is the question:", "Shall I compare thee to a summer's day?",
           "The quick brown fox"]


@pytest.fixture(scope="module")
def compiled_demo() -> LLM:
    # prefix caching off: a cached prompt's last chunk is attended in another shape than a cold one (its last
    # bits can differ), and each prompt here runs several times
    return LLM(str(DEMO), speculative_method="eagle3", compile=True, enable_prefix_caching=False)


def greedy(llm: LLM, k, **options) -> list[list[int]]:
    params = SamplingParams.from_dict(dict(temperature=0, max_tokens=40, ignore_eos=True, num_assistant_tokens=k,
                                           **options))
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("k, options", [(3, {}), (6, {"branching_factor": 2, "tree_depth": 2}), ("auto", {})])
def test_greedy_speculation_under_compile_equals_plain(compiled_demo, k, options):
    assert compiled_demo.engine.model.compiled is not None
    plain = greedy(compiled_demo, 0)
    assert greedy(compiled_demo, k, **options) == plain


def forward_both_ways(llm: LLM, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states of a prompt's forward, compiled and eager, in fresh blocks."""
    engine, model = llm.engine, llm.engine.model
    item = ForwardItem(list(range(-(-len(token_ids) // engine.block_manager.block_size))), 0, token_ids)
    compiled, _ = engine.runner.forward([item])
    kept, model.compiled = model.compiled, None
    try:
        eager, _ = engine.runner.forward([item])
    finally:
        model.compiled = kept
    return compiled, eager


def test_compiled_forward_is_close_to_eager(compiled_demo):
    ids = compiled_demo.engine.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    compiled, eager = forward_both_ways(compiled_demo, ids)
    torch.testing.assert_close(compiled.float(), eager.float(), atol=0.1, rtol=0.05)
    logits = compiled_demo.engine.model.compute_logits
    agree = (logits(compiled).argmax(-1) == logits(eager).argmax(-1)).float().mean().item()
    assert agree >= 0.9


@pytest.mark.parametrize("native", [False, True])
def test_a_second_compiled_model_keeps_its_own_graph_and_int8_products_are_in_it(compiled_demo, qwen3_dir, native,
                                                                                  monkeypatch):
    """Dynamo keeps graphs per code object and the guards on weights are dropped: without a code object of its
    own, this model would run the demo model's graph. Its int8 products are torch's aten ops the graph calls
    itself, or (native, on an AVX512-VNNI CPU) the native kernel behind the opaque specserve::linear."""
    from specserve.layers import kernels
    from specserve.models.compiled import graph_linear
    if native and kernels.a8_linear_library() is None:
        pytest.skip("no AVX512-VNNI (or no C compiler) on this CPU")
    if not native:
        monkeypatch.setattr(kernels, "a8_linear_library", lambda: None)
    llm = LLM(str(qwen3_dir), speculative_method="ngram", compile=True, quantization="int8", dtype="bfloat16",
              enable_prefix_caching=False)
    qkv = graph_linear(llm.engine.model.model.layers[0].self_attn.qkv_proj)
    expected = torch.ops.specserve.linear if native else torch.ops.aten._weight_int8pack_mm
    assert isinstance(qkv, functools.partial) and qkv.func is expected
    compiled, eager = forward_both_ways(llm, list(range(5, 40)))
    torch.testing.assert_close(compiled.float(), eager.float(), atol=0.05, rtol=0.05)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, num_assistant_tokens=0)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    params.num_assistant_tokens = 4
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == plain


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    return parser


def test_the_compile_flag_reaches_the_engine_and_rejects_tensor_parallelism():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--compile"])
    assert engine_config_from_args(args).compile is True
    assert engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x"])).compile is False
    with pytest.raises(ValueError, match="--compile"):
        EngineConfig(model=str(DEMO), compile=True, tensor_parallel_size=2)
