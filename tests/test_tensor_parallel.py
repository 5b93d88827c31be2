"""Tensor parallelism (specserve/distributed/): two gloo ranks on CPU give the tokens one process gives, for plain
decoding and every drafting method; a worker's death is a 503 and the server's exit, never a hang."""
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from specserve.config import default_model_dir, demo_model_dir
from specserve.distributed.plan import ShardPlan, describe
from specserve.llm import LLM
from specserve.models.config import ModelConfig
from specserve.sampling_params import SamplingParams

from conftest import make_checkpoint

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
           "To be, or not to be, that is the question"]


def greedy(max_tokens=24, **kw):
    return SamplingParams.from_dict(dict(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw))


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def tp_tokens(model, methods, max_tokens=24, must_draft=True, **kw):
    """{method: tokens} from one TP=2 engine per method; "none" is the first engine's plain decoding (k=0).
    With must_draft, every method's run must have made drafts, or it would only repeat plain decoding."""
    out = {}
    for method in methods:
        llm = LLM(str(model), dtype="float32", kv_cache_memory_gb=0.01, speculative_method=method,
                  tensor_parallel_size=2, **kw)
        try:
            outputs = llm.generate(PROMPTS, greedy(max_tokens))
            assert not must_draft or sum(o.spec["num_drafts"] for o in outputs) > 0, method
            out[method] = ids(outputs)
            if "none" not in out:
                out["none"] = ids(llm.generate(PROMPTS, greedy(max_tokens, num_assistant_tokens=0)))
        finally:
            llm.engine.model.close()
    return out


def reference(model, max_tokens=24, **kw):
    return ids(LLM(str(model), dtype="float32", kv_cache_memory_gb=0.01, speculative_method="none", **kw)
               .generate(PROMPTS, greedy(max_tokens)))


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    """A target and a draft of its first two layers (as in test_spec.py): they agree often, not always."""
    root = tmp_path_factory.mktemp("tp")
    target = make_checkpoint(root / "target", "qwen3", layers=4, seed=3, initializer_range=0.2)
    weights = load_file(target / "model.safetensors")
    draft = make_checkpoint(target / "draft", "qwen3", layers=2, seed=3, initializer_range=0.2)
    save_file({k: v for k, v in weights.items() if not k.startswith(("model.layers.2.", "model.layers.3."))},
              draft / "model.safetensors", metadata={"format": "pt"})
    return target


def test_qwen3_plain_and_draft_model(qwen3_pair):
    """(n-gram drafting, which reads only tokens, is run on TP by the Llama and SmolLM2 tests.)"""
    want = reference(qwen3_pair)
    got = tp_tokens(qwen3_pair, ["draft"])
    assert got == {"none": want, "draft": want}
    assert len(set(want[0])) > 3                      # not a degenerate repetition


def test_llama_uneven_vocab_and_bias(tmp_path):
    """Llama, untied head, a vocabulary the ranks split with padding (401 rows), q/k/v biases, and an int8 KV
    cache: each rank quantizes its own heads, so its scales must travel with its share of the cache."""
    model = make_checkpoint(tmp_path / "llama", "llama", vocab_size=401, seed=5, initializer_range=0.2,
                            tie_word_embeddings=False, attention_bias=True)
    want = reference(model, kv_cache_dtype="int8")  # n-gram finds nothing to draft here: both runs are plain
    assert tp_tokens(model, ["ngram"], must_draft=False, kv_cache_dtype="int8") == {"none": want, "ngram": want}


def test_demo_model_eagle3_and_mtp():
    """The drafters on rank 0 read the sharded target's embedding, norm and logits through the ranks."""
    model = demo_model_dir()
    want = reference(model, 16)
    assert tp_tokens(model, ["eagle3", "mtp"], 16) == {"none": want, "eagle3": want, "mtp": want}


def test_default_model_uneven_heads():
    """SmolLM2-135M: 9 query / 3 KV heads over 2 ranks: rank 0 holds KV heads 0-1, rank 1 KV head 2."""
    model = default_model_dir()
    want = reference(model, 8)
    assert tp_tokens(model, ["ngram"], 8) == {"none": want, "ngram": want}


def config(heads, kv, vocab=400, ffn=128):
    return ModelConfig(["LlamaForCausalLM"], vocab, 64, ffn, 2, heads, kv, 16)


def test_plans_split_replicate_or_refuse():
    even = [ShardPlan.of(config(4, 2), 2, r) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in even] == [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]
    uneven = [ShardPlan.of(config(9, 3, vocab=49152, ffn=1536), 2, r) for r in range(2)]
    assert [(p.q_heads, p.kv_heads, len(p.ffn)) for p in uneven] == [(range(0, 6), range(0, 2), 768),
                                                                    (range(6, 9), range(2, 3), 768)]
    replicated = [ShardPlan.of(config(4, 2), 4, r).kv_heads for r in range(4)]
    assert replicated == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert "replicated 2x" in describe(config(4, 2), 4) and "unevenly" in describe(config(9, 3), 2)
    with pytest.raises(ValueError, match="cannot shard 4 query / 3 KV heads"):
        ShardPlan.of(config(4, 3), 4, 0)
    padded = [ShardPlan.of(config(4, 2, vocab=401), 2, r).vocab for r in range(2)]
    assert padded == [range(0, 201), range(201, 402)]


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> None:
    """Until the server process answers /health (it must not exit first)."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)


def test_worker_death_is_a_503_and_the_server_exits(qwen3_pair):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specserve.server.cli", "serve", str(qwen3_pair), "--port",
                             str(port), "--kv-cache-memory-gb", "0.01", "--speculative-method", "none",
                             "--dtype", "float32", "--tensor-parallel-size", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port, 90)
        [worker] = children(proc.pid)
        result = {}
        request = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", timeout=60,
            json={"prompt": "def", "max_tokens": 1000, "ignore_eos": True})))
        request.start()
        time.sleep(0.5)                     # the request is decoding
        subprocess.run(["kill", "-9", str(worker)], check=True)
        request.join(60)
        response = result["r"]
        assert response.status_code == 503, response.text
        assert "worker rank 1" in response.json()["error"]["message"]
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    assert "exited with code -9" in out and "exiting with status 1" in out


def test_torchrun_launch_serves_on_rank_0(tmp_path):
    """The multi-node path on one node: torchrun starts both ranks (c10d rendezvous), rank 0 serves HTTP and
    answers with the tokens of one process."""
    demo = demo_model_dir()
    want = LLM(str(demo), dtype="float32", speculative_method="none", kv_cache_memory_gb=0.05).generate(
        [PROMPTS[0]], greedy(12))[0].outputs[0].text
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "specserve-test",
         "-m", "specserve.server.cli", "serve", str(demo), "--tensor-parallel-size", "2", "--port", str(port),
         "--speculative-method", "none", "--dtype", "float32", "--kv-cache-memory-gb", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port, 120)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    finally:
        proc.terminate()
        proc.wait(30)
