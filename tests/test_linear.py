"""Inference-prepared models (packed linears, frozen layer weights) against F.linear and transformers."""
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from specserve.engine.model_runner import ForwardItem, ModelRunner
from specserve.layers import linear
from specserve.layers.linear import PackedLinear, pack_linears
from specserve.llm import LLM
from specserve.models import llama
from specserve.models.llama import rms_norm, rms_norm_fused
from specserve.models.registry import load_model
from specserve.sampling_params import SamplingParams
from cpu_features import without_bf16_onednn

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not linear.can_pack(CPU, torch.float32), reason="no oneDNN in this torch build")


@pytest.fixture(params=["qwen3", "llama"])
def model_dir(request, qwen3_dir, llama_dir):
    return qwen3_dir if request.param == "qwen3" else llama_dir


@pytest.fixture(params=["this-cpu", "no-bf16-onednn"])
def bf16_cpu(request, monkeypatch):
    """Each bf16 test runs twice: on this CPU's own kernels, and as on a CPU without oneDNN bf16 (AVX2)."""
    if request.param == "no-bf16-onednn":
        without_bf16_onednn(monkeypatch)
    return request.param


def test_without_bf16_onednn_the_check_and_the_error_are_those_of_an_avx2_cpu(monkeypatch):
    without_bf16_onednn(monkeypatch)
    assert not linear.bf16_packing_supported() and not linear.can_pack(CPU, torch.bfloat16)
    assert linear.can_pack(CPU, torch.float32)
    with pytest.raises(RuntimeError, match="bf16 path needs the cpu support"):
        PackedLinear(torch.randn(8, 8).bfloat16(), None)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_linear_is_the_same_product(rows, bf16_cpu):
    torch.manual_seed(0)
    w, b = torch.randn(96, 40), torch.randn(96)
    x = torch.randn(rows, 40)
    with torch.inference_mode():
        assert torch.allclose(PackedLinear(w, b)(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        w16, x16 = w.bfloat16(), x.bfloat16()
        plain = nn.Linear(40, 96, bias=False).bfloat16()
        plain.weight.data = w16
        inference = pack_linears(nn.Sequential(plain), CPU, torch.bfloat16)[0]      # what this CPU runs bf16 on
        assert isinstance(inference, PackedLinear) == linear.bf16_packing_supported()
        assert torch.equal(inference(x16), F.linear(x16, w16))                      # bf16: bit for bit


def test_pack_linears_keeps_plain_copies_of_small_fp32_weights(monkeypatch):
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 4 * 64 * 64)
    def tree(dtype):
        return nn.Sequential(nn.Linear(64, 64), nn.Sequential(nn.Linear(8, 8), nn.Linear(64, 128))).to(dtype)
    fp32 = pack_linears(tree(torch.float32), CPU, torch.float32)
    mods = (fp32[0], fp32[1][0], fp32[1][1])
    assert all(isinstance(m, PackedLinear) for m in mods)
    assert [m.weight is not None for m in mods] == [False, True, False]
    bf16 = pack_linears(tree(torch.bfloat16), CPU, torch.bfloat16)
    if linear.bf16_packing_supported():
        assert all(isinstance(m, PackedLinear) and m.weight is None for m in (bf16[0], bf16[1][0], bf16[1][1]))
    else:                                                       # AVX2: bf16 products stay on F.linear
        assert all(isinstance(m, nn.Linear) for m in (bf16[0], bf16[1][0], bf16[1][1]))
    meta = pack_linears(tree(torch.float32), torch.device("meta"), torch.float32)
    assert isinstance(meta[0], nn.Linear)                                          # only CPU packs
    small = fp32[1][0]
    with torch.inference_mode():           # both paths of a small weight: plain under PLAIN_MAX_ROWS rows
        for rows in (1, linear.PLAIN_MAX_ROWS + 1):
            x = torch.randn(rows, 8)
            assert torch.allclose(small(x), F.linear(x, small.weight, small.bias), rtol=1e-5, atol=1e-6)


def test_rms_norm_rounds_like_transformers():
    torch.manual_seed(0)
    x, w = torch.randn(64, 96).bfloat16(), (torch.randn(96) * 0.5 + 1).bfloat16()
    ref = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(96, eps=1e-6)
    ref.weight.data = w
    assert torch.equal(rms_norm(x, w, 1e-6), ref(x))


def test_fused_rms_norm_is_rms_norm():
    """The inference path's RMSNorm (LayerNorm of [x, -x]): bf16 bit for bit, fp32 to rounding."""
    torch.manual_seed(0)
    for dim in (16, 256, 768):
        x, w = torch.randn(64, dim) * 3, torch.randn(dim) * 0.5 + 1
        assert torch.equal(rms_norm_fused(x.bfloat16(), w.bfloat16(), 1e-6), rms_norm(x.bfloat16(), w.bfloat16(), 1e-6))
        assert torch.allclose(rms_norm_fused(x, w, 1e-6), rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def run_logits(model, dtype, ids):
    c = model.config
    runner = ModelRunner(model, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 64, 4, dtype)
    table = list(range(8))
    rows = [runner.forward([ForwardItem(table, 0, ids[:20])])[0]]
    rows += [runner.forward([ForwardItem(table, i, [ids[i]])])[0] for i in range(20, len(ids))]
    return model.compute_logits(torch.cat(rows)).float()


def test_packed_fp32_model_matches_transformers(model_dir, monkeypatch):
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)                 # pack every linear of the tiny model
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model = load_model(model_dir).pack(CPU, torch.float32)
    assert isinstance(model.lm_head, PackedLinear) and all(layer.frozen is not None for layer in model.model.layers)
    ids = torch.randint(0, 400, (30,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (run_logits(model, torch.float32, ids) - expected).abs().max() <= 1e-4


def test_bf16_model_matches_transformers_bf16(model_dir, bf16_cpu):
    """Packed bf16 products are oneDNN's own and the norms round in transformers' order; attention runs in
    fp32 (layers/attention.py), so the logits differ from transformers' bf16 ones by about one bf16 step."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    model = load_model(model_dir, torch.bfloat16).pack(CPU, torch.bfloat16)
    ids = torch.randint(0, 400, (30,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
        exact = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()(torch.tensor([ids])).logits[0]
    got = run_logits(model, torch.bfloat16, ids)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= scale / 64
    assert (got - exact).abs().max() <= (expected - exact).abs().max() + scale / 128   # no further from fp32


@pytest.mark.parametrize("min_bytes", [0, 1 << 40])      # everything packed only / small copies kept too
def test_packed_engine_greedy_equals_unpacked(qwen3_dir, monkeypatch, min_bytes):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def fibonacci(n):", "To be, or not to be"]
    with monkeypatch.context() as m:
        m.setattr(linear, "can_pack", lambda device, dtype: False)
        m.setattr(llama, "can_pack", lambda device, dtype: False)
        unpacked = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01)
        assert not isinstance(unpacked.engine.model.lm_head, PackedLinear)
        plain = [o.outputs[0].token_ids for o in unpacked.generate(prompts, params)]
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", min_bytes)
    for method in ("none", "ngram"):                      # n-gram: verify steps of several rows
        llm = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01, speculative_method=method)
        assert isinstance(llm.engine.model.lm_head, PackedLinear)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


def test_bf16_engine_without_bf16_onednn_runs_and_speculation_is_exact(qwen3_dir, monkeypatch):
    """An AVX2-only CPU: an explicit bf16 engine takes F.linear for its bf16 products (nothing packed in bf16,
    nothing raising), greedy n-gram decoding equals plain, and auto picks fp32 there."""
    from specserve.engine.llm_engine import resolve_dtype
    from specserve.models.config import ModelConfig
    without_bf16_onednn(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def fibonacci(n):", "To be, or not to be"]
    outs = []
    for method in ("none", "ngram"):
        llm = LLM(str(qwen3_dir), dtype="bfloat16", kv_cache_memory_gb=0.01, speculative_method=method)
        assert not any(isinstance(m, PackedLinear) for m in llm.engine.model.modules())
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1] and all(len(t) == 24 for t in outs[0])
    assert resolve_dtype("auto", ModelConfig.from_pretrained(qwen3_dir), CPU) == torch.float32 \
        or ModelConfig.from_pretrained(qwen3_dir).torch_dtype != "bfloat16"
