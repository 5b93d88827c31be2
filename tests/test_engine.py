"""The plain engine against transformers on random tiny Qwen3 and Llama checkpoints."""
import pytest
import torch
import transformers

from specserve.runtime.model_runner import ForwardItem, ModelRunner
from specserve.config import demo_model_dir
from specserve.llm import LLM
from specserve.models.registry import load_model
from specserve.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):", "To be, or not to be, that is", "The quick brown fox jumps over the lazy dog. The quick"]


@pytest.fixture(params=["qwen3", "llama"])
def model_dir(request, qwen3_dir, llama_dir):
    return qwen3_dir if request.param == "qwen3" else llama_dir


def runner_for(model, num_blocks=64, block_size=4):
    c = model.config
    return ModelRunner(model, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_blocks, block_size, torch.float32)


def test_unknown_architecture_lists_supported(tmp_path, qwen3_dir):
    import json, shutil
    shutil.copytree(qwen3_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, .*Qwen3ForCausalLM"):
        load_model(tmp_path / "m")


def test_logits_match_transformers_prefill_and_decode(model_dir):
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model = load_model(model_dir)
    runner = runner_for(model)
    ids = torch.randint(0, 400, (30,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    table = list(range(8))
    hidden, _ = runner.forward([ForwardItem(table, 0, ids[:20])])                   # prefill
    assert (model.compute_logits(hidden) - expected[:20]).abs().max() <= 1e-4
    for i in range(20, 30):                                                        # decode steps
        hidden, _ = runner.forward([ForwardItem(table, i, [ids[i]])])
        assert (model.compute_logits(hidden)[0] - expected[i]).abs().max() <= 1e-4


def test_greedy_matches_transformers_generate(model_dir):
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    llm = LLM(str(model_dir), kv_cache_memory_gb=0.01, speculative_method="none")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()


def test_batch_equals_each_alone(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01, speculative_method="none", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_prefix_cache_hit_equals_miss(qwen3_dir):
    prompt = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    miss = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01, speculative_method="none", block_size=4)
    first = miss.generate(prompt, params)[0].outputs[0].token_ids
    second_seq = miss.engine.add_request(miss.tokenizer.encode(prompt), params)
    while miss.engine.has_unfinished():
        miss.engine.step()
    assert second_seq.num_cached_tokens >= 8
    assert second_seq.output_token_ids == first
    cold = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01, speculative_method="none", enable_prefix_caching=False)
    assert cold.generate(prompt, params)[0].outputs[0].token_ids == first


def test_a_request_that_ends_in_its_prompt_step_caches_its_prompt(qwen3_dir):
    """max_tokens=1 finishes in the step that computes the prompt: its blocks are still hashed before they are freed
    (as vLLM caches them), so the same prompt again is a hit, with the same output."""
    prompt = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
    llm = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01, speculative_method="none", block_size=4)
    ids = llm.tokenizer.encode(prompt)
    one = SamplingParams(temperature=0, max_tokens=1)
    first = llm.generate(prompt, one)[0].outputs[0].token_ids
    again = llm.engine.add_request(ids, one)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert again.num_cached_tokens == (len(ids) - 1) // 4 * 4 and again.output_token_ids == first


def test_truncate_then_extend_equals_never_extending(qwen3_dir):
    from specserve.engine.block_manager import BlockManager
    from specserve.runtime.sequence import Sequence
    model = load_model(qwen3_dir)
    runner = runner_for(model, num_blocks=16, block_size=4)
    bm = BlockManager(16, 4)
    ids = torch.randint(0, 400, (14,)).tolist()
    seq = Sequence(ids[:10], SamplingParams())
    bm.allocate(seq)
    bm.ensure(seq, 10)
    runner.forward([ForwardItem(seq.block_table, 0, ids[:10])])
    bm.ensure(seq, 17)                                          # speculative junk past position 10
    runner.forward([ForwardItem(seq.block_table, 10, [7, 8, 9, 10, 11, 12, 13])])
    bm.truncate(seq, 10)
    assert len(seq.block_table) == 3
    bm.ensure(seq, 14)
    hidden, _ = runner.forward([ForwardItem(seq.block_table, 10, ids[10:14])])
    fresh = runner_for(model, num_blocks=16, block_size=4)
    expected, _ = fresh.forward([ForwardItem(list(range(4)), 0, ids)])
    assert torch.allclose(hidden, expected[10:], atol=1e-5)


def test_stop_strings_tokens_and_max_tokens(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01, speculative_method="none")
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 30 and base.finish_reason == "length"
    stop_token = base.token_ids[5]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  stop_token_ids=[stop_token]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:base.token_ids.index(stop_token) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    stop = base.text[10:13]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == base.text[:base.text.index(stop)] and out.stop_reason == stop


def test_seeded_sampling_is_reproducible(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01, speculative_method="none")
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    a = llm.generate(PROMPTS, params)
    b = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_prompt_that_cannot_fit_is_a_clear_error(qwen3_dir):
    from specserve.engine.llm_engine import RequestError
    llm = LLM(str(qwen3_dir), kv_cache_memory_gb=0.0001, speculative_method="none")
    with pytest.raises(RequestError, match="accepts at most"):
        llm.generate([list(range(3, 400)) * 3], SamplingParams(max_tokens=4))


def test_preemption_when_memory_runs_out_keeps_outputs(qwen3_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01, speculative_method="none")
    expected = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, params)]
    # 6 blocks of 16 tokens cannot hold three sequences of ~50 tokens at once: someone is preempted
    tight = LLM(str(qwen3_dir), kv_cache_memory_gb=6 * 16 * 2 * 2 * 2 * 16 * 4 / (1 << 30), speculative_method="none")
    assert tight.engine.block_manager.num_blocks == 6
    assert [o.outputs[0].token_ids for o in tight.generate(PROMPTS, params)] == expected


def test_sharded_checkpoint_loads(tmp_path, qwen3_dir):
    from conftest import make_checkpoint
    sharded = make_checkpoint(tmp_path / "sharded", "qwen3", tie_word_embeddings=True, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a = load_model(sharded)
    b = load_model(qwen3_dir)
    ids = torch.arange(20)
    assert torch.equal(a.compute_logits(a(ids[None], torch.arange(20))[0]), b.compute_logits(b(ids[None], torch.arange(20))[0]))


@pytest.mark.parametrize("cpu", ["this-cpu", "no-bf16-onednn"])
def test_bfloat16_close_to_float32(qwen3_dir, cpu, monkeypatch):
    if cpu == "no-bf16-onednn":                     # as on an AVX2-only CPU: bf16 products without oneDNN
        from cpu_features import without_bf16_onednn
        without_bf16_onednn(monkeypatch)
    ids = torch.randint(0, 400, (1, 24))
    m32, m16 = load_model(qwen3_dir, torch.float32), load_model(qwen3_dir, torch.bfloat16)
    l32 = m32.compute_logits(m32(ids, torch.arange(24))[0])
    l16 = m16.compute_logits(m16(ids, torch.arange(24))[0]).float()
    assert (l32 - l16).abs().max() < 0.1 * l32.abs().max()
    llm = LLM(str(qwen3_dir), dtype="bfloat16", kv_cache_memory_gb=0.01, speculative_method="none")
    # K/V of a bf16 model on CPU: bf16 where the CPU has bf16 products, else fp32, where its attention then runs
    from specserve.layers.attention import kv_cache_dtype
    assert llm.engine.runner.kv_cache.dtype == kv_cache_dtype(torch.bfloat16, llm.engine.device)
    assert kv_cache_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    assert len(llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids) == 8


def test_auto_dtype_on_cpu_follows_a_bf16_checkpoint():
    from specserve.engine.llm_engine import resolve_dtype
    from specserve.models.config import ModelConfig
    cpu = torch.device("cpu")
    shape = dict(architectures=["Qwen3ForCausalLM"], vocab_size=8, hidden_size=8, intermediate_size=8,
                 num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8)
    bf16_ok = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert resolve_dtype("auto", ModelConfig(**shape, torch_dtype="bfloat16"), cpu) == (torch.bfloat16 if bf16_ok else torch.float32)
    assert resolve_dtype("auto", ModelConfig(**shape, torch_dtype="float32"), cpu) == torch.float32
    assert resolve_dtype("auto", ModelConfig(**shape, torch_dtype="float16"), cpu) == torch.float32
    assert resolve_dtype("float32", ModelConfig(**shape, torch_dtype="bfloat16"), cpu) == torch.float32


def test_cpu_threads_one_for_cached_weights_else_all_cores_but_the_reserved(monkeypatch):
    from specserve.runtime.device import CACHE_RESIDENT_BYTES, set_cpu_threads
    small, large = torch.nn.Linear(8, 8), torch.nn.Linear(CACHE_RESIDENT_BYTES // 4 // 1024 + 1, 1024, bias=False)
    calls = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    set_cpu_threads(None, small)
    set_cpu_threads(None, large)                 # torch's default (every core) stays
    set_cpu_threads(None, large, reserved_cores=1)
    set_cpu_threads(None, small, reserved_cores=1)
    set_cpu_threads(3, large, reserved_cores=1)  # a number given is obeyed
    assert calls == [1, 3, 1, 3]


FAULTS_SCRIPT = """
import resource, sys, threading, torch
from specserve.runtime.device import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def step(rows):     # a forward's temporaries, made and freed: four activations of rows x 1536 bf16
    return sum(float(x[0, 0]) for x in [torch.ones(rows, 1536, dtype=torch.bfloat16) for _ in range(4)])
out = {}
def engine_thread():        # the server's engine runs in a thread, which allocates from an arena of its own
    step(256), step(2048)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        for rows in (256, 2048, 8, 2048):
            step(rows)
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
thread = threading.Thread(target=engine_thread)
thread.start(), thread.join()
print(kept, out["faults"])
"""


def test_freed_memory_is_reused_not_faulted_in_again():
    """keep_freed_memory fixes glibc's malloc thresholds, so a thread's steps reuse what the last step freed: the same
    temporaries, made and freed 80 times over, fault in under a tenth of their pages (glibc's moving thresholds faulted
    in 70% of them on every pass, and made a plain server's speed depend on the prompts it had served first)."""
    import subprocess
    import sys
    pages = 20 * 4 * (256 + 2048 + 8 + 2048) * 1536 * 2 // 4096
    runs = {how: subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, how], capture_output=True, text=True,
                                check=True).stdout.split() for how in ("keep", "default")}
    if runs["keep"][0] != "True":
        pytest.skip("this C library has no mallopt (not glibc)")
    assert int(runs["keep"][1]) < pages / 10 < int(runs["default"][1])


def test_a_cpu_engine_keeps_freed_memory(monkeypatch):
    from specserve.runtime import device
    calls = []
    monkeypatch.setattr(device, "keep_freed_memory", lambda: calls.append(1) or True)
    LLM(str(demo_model_dir()), speculative_method="none")
    assert calls == [1]


def test_the_server_runs_wide_forwards_on_every_core(monkeypatch):
    """With a core left to the HTTP front end, a forward of WIDE_FORWARD_TOKENS tokens or more (a prompt chunk, a
    large batch) takes every core and a decode-sized one the rest; torch is told only on a change. An engine made
    after a narrow forward still counts every core. A number given, or a model whose weights fit in cache, keeps
    one count."""
    from specserve.runtime import device
    large = torch.nn.Linear(device.CACHE_RESIDENT_BYTES // 4 // 1024 + 1, 1024, bias=False)
    threads = [4]
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[-1])
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(device.FORWARD_THREADS, "narrow", 0)      # restored after the test, as set_cpu_threads sets
    monkeypatch.setattr(device.FORWARD_THREADS, "wide", 0)
    device.set_cpu_threads(None, large, reserved_cores=1)
    for tokens in (1, device.WIDE_FORWARD_TOKENS - 1, device.WIDE_FORWARD_TOKENS, 500, 2, 3):
        device.FORWARD_THREADS.fit(tokens)
    assert threads == [4, 3, 4, 3]
    device.set_cpu_threads(None, large, reserved_cores=1)         # a second engine, after a narrow forward
    assert (device.FORWARD_THREADS.narrow, device.FORWARD_THREADS.wide, threads[-1]) == (3, 4, 3)
    for num_threads, model in ((2, large), (None, torch.nn.Linear(8, 8))):
        device.set_cpu_threads(num_threads, model, reserved_cores=1)
        device.FORWARD_THREADS.fit(500)
        assert threads[-1] == (num_threads or 1)


def test_step_outputs_carry_snapshots_the_engine_does_not_change(qwen3_dir):
    import dataclasses
    engine = LLM(str(qwen3_dir), kv_cache_memory_gb=0.01, speculative_method="none").engine
    seq = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    first = engine.step()[0].seq
    assert (first.num_output_tokens, first.finish_reason, first.spec.num_target_forwards) == (1, None, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.output_text = "changed"
    last = None
    while not seq.is_finished:
        last = engine.step()[0].seq
    assert (first.num_output_tokens, first.finish_reason, first.spec.num_target_forwards) == (1, None, 1)
    assert (last.num_output_tokens, last.finish_reason, last.spec.num_target_forwards) == (3, "length", 3)
    assert last.prompt_token_ids == (5, 6, 7) and last.num_prompt_tokens == 3 and last.is_finished
    assert last.output_text == seq.output_text and last.request_id == seq.request_id
