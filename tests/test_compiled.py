"""--compile (models/compiled.py): the target's paged forward as torch.compile graphs on CPU. Greedy speculation
stays exact under it, its forward stays close to the eager one, and two compiled models in one process keep
their own graphs."""
import argparse
import functools
import os
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

from conftest import write_eagle3_head

DEMO = Path(specserve.__file__).parent / "demo_model"
PROMPTS = ["To be, or not to be, that is the question:", "Shall I compare thee to a summer's day?",
           "The quick brown fox"]


@pytest.fixture(scope="module")
def compiled_qwen3(qwen3_dir, tmp_path_factory) -> LLM:
    """The 2-layer random qwen3 under compile, with a random EAGLE3 head reading the states entering its layers 0
    and 1 (equality is what is tested, not acceptance; a small target keeps inductor's lowering short)."""
    head = write_eagle3_head(tmp_path_factory.mktemp("compiled") / "eagle3", hidden=64, vocab_size=400,
                             draft_vocab_size=64, aux_layer_ids=[0, 1, 1], intermediate=128, heads=4, kv_heads=2,
                             head_dim=16, rope_theta=10000.0, max_positions=1024)
    # prefix caching off: a cached prompt's last chunk is attended in another shape than a cold one (its last
    # bits can differ), and each prompt here runs several times
    return LLM(str(qwen3_dir), speculative_method="eagle3", draft_model=str(head), compile=True,
               enable_prefix_caching=False)


def greedy(llm: LLM, k, **options) -> tuple[list[list[int]], int]:
    params = SamplingParams.from_dict(dict(temperature=0, max_tokens=40, ignore_eos=True, num_assistant_tokens=k,
                                           **options))
    outs = llm.generate(PROMPTS, params)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)     # a failed step would finish them empty
    return [o.outputs[0].token_ids for o in outs], sum(o.spec["num_draft_tokens"] for o in outs)


# greedy() checks every request's length: when the compiled graph returned no aux hidden states, EAGLE3's first
# step failed, every request ended empty, and two empty outputs compared equal
@pytest.mark.parametrize("k, options", [(3, {}), (6, {"branching_factor": 2, "tree_depth": 2}), ("auto", {})])
def test_greedy_speculation_under_compile_equals_plain(compiled_qwen3, k, options):
    assert compiled_qwen3.engine.model.compiled is not None
    plain, _ = greedy(compiled_qwen3, 0)
    tokens, num_drafted = greedy(compiled_qwen3, k, **options)
    assert tokens == plain
    assert num_drafted > 0 or k == "auto"      # auto may rightly draft nothing with a random head


def forward_both_ways(llm: LLM, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states of a prompt's forward, compiled and eager, in fresh blocks."""
    engine, model = llm.engine, llm.engine.model
    item = ForwardItem(list(range(-(-len(token_ids) // engine.block_manager.block_size))), 0, token_ids)
    # with the proposer's aux layers, as the engine runs it: the graph compiled at start-up, not a third one
    compiled, _ = engine.runner.forward([item], engine.proposer.aux_layers)
    kept, model.compiled = model.compiled, None
    try:
        eager, _ = engine.runner.forward([item], engine.proposer.aux_layers)
    finally:
        model.compiled = kept
    return compiled, eager


def test_compiled_forward_is_close_to_eager(compiled_qwen3):
    ids = compiled_qwen3.engine.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    compiled, eager = forward_both_ways(compiled_qwen3, ids)
    torch.testing.assert_close(compiled.float(), eager.float(), atol=0.1, rtol=0.05)
    logits = compiled_qwen3.engine.model.compute_logits
    agree = (logits(compiled).argmax(-1) == logits(eager).argmax(-1)).float().mean().item()
    assert agree >= 0.9


def test_a_second_compiled_model_keeps_its_own_graph_and_int8_products_are_in_it(compiled_qwen3, llama_dir):
    """Dynamo keeps graphs per code object and the guards on weights are dropped: without a code object of its
    own, this model (other weights than the qwen3 compiled above) would run that model's graph. Its int8 products
    are the kernel this CPU selects: the native kernel behind the opaque specserve::linear (AVX512-VNNI and a C
    compiler), else torch's aten op the graph calls itself."""
    from specserve.layers import kernels
    from specserve.models.compiled import graph_linear
    native = kernels.a8_linear_library() is not None
    llm = LLM(str(llama_dir), speculative_method="ngram", compile=True, quantization="int8", dtype="bfloat16",
              enable_prefix_caching=False)
    qkv = graph_linear(llm.engine.model.model.layers[0].self_attn.qkv_proj)
    expected = torch.ops.specserve.linear if native else torch.ops.aten._weight_int8pack_mm
    assert isinstance(qkv, functools.partial) and qkv.func is expected
    compiled, eager = forward_both_ways(llm, list(range(5, 40)))
    torch.testing.assert_close(compiled.float(), eager.float(), atol=0.05, rtol=0.05)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, num_assistant_tokens=0)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert all(len(tokens) == 30 for tokens in plain)
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


def test_inductor_cache_is_kept_per_vector_isa(monkeypatch):
    """Kernels inductor cached for AVX-512 and built again for AVX2 left half of each output unwritten (NaN): unless
    the user names a folder, --compile keeps one per ISA."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from specserve.models.compiled import key_inductor_cache_by_isa
    isa = "_".join(str(pick_vec_isa()).split()) or "novec"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    key_inductor_cache_by_isa()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir()) + "_" + isa
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))   # inductor set its default
    key_inductor_cache_by_isa()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("_" + isa)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/mine")                        # the user's choice
    key_inductor_cache_by_isa()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/mine"
