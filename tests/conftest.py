"""Tiny random checkpoints written with transformers' save_pretrained, plus a small byte-level BPE tokenizer."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
        "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n"
        "The quick brown fox jumps over the lazy dog. ") * 20


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): two workers on two cores, at most four on larger machines. Most tests
    are bound by Python's per-step overhead on tiny models, so two processes on two cores finish the suite
    in about 60% of one process's time (benchmarks/NOTES.md, session 15)."""
    cpus = os.cpu_count() or 1
    return min(2, cpus) if cpus <= 4 else min(4, cpus // 2)


def pytest_configure(config) -> None:
    """Each worker's torch threads: its share of the cores, never fewer than two (the default on two cores; the
    tests that compare bits at one and two threads pin two with `two_threads`)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(2, (os.cpu_count() or 1) // workers))


@pytest.fixture
def two_threads():
    """Torch at two threads for the test (an engine for a tiny model sets one, process-wide), restored after:
    tests that compare a kernel's bits at one thread with its bits at two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def specserve_cache(tmp_path_factory) -> Path:
    """specserve's cache (GGUF conversions, file digests) in a folder of this session: the default model is
    converted once per session, and never into the user's own cache."""
    path = tmp_path_factory.mktemp("specserve-cache")
    os.environ["SPECSERVE_CACHE_DIR"] = str(path)
    return path


def write_tokenizer(out: Path, vocab_size: int = 400) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHATML, "model_max_length": 1024}))


def make_checkpoint(out: Path, arch: str = "qwen3", vocab_size: int = 400, hidden: int = 64, layers: int = 2,
                    seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=2,
                  bos_token_id=None, pad_token_id=0)
    common.update(overrides)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    write_tokenizer(out, vocab_size)
    return out


def write_eagle3_head(out: Path, hidden: int, vocab_size: int, draft_vocab_size: int, aux_layer_ids: list[int],
                      intermediate: int, heads: int, kv_heads: int, head_dim: int, rope_theta: float,
                      max_positions: int, seed: int = 0) -> Path:
    """A random EAGLE3 head in the published layout (EAGLE, SpecForge): one Llama layer whose q/k/v read
    2 x hidden, fc over three target layers, a draft vocabulary mapped by d2t. Acceptance does not matter."""
    from safetensors.torch import save_file
    H, I, V, Vd = hidden, intermediate, vocab_size, draft_vocab_size
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05
    d2t = torch.randperm(V, generator=g)[:Vd].sort().values
    w = {"fc.weight": r(H, 3 * H), "midlayer.self_attn.q_proj.weight": r(heads * head_dim, 2 * H),
         "midlayer.self_attn.k_proj.weight": r(kv_heads * head_dim, 2 * H),
         "midlayer.self_attn.v_proj.weight": r(kv_heads * head_dim, 2 * H),
         "midlayer.self_attn.o_proj.weight": r(H, heads * head_dim), "midlayer.mlp.gate_proj.weight": r(I, H),
         "midlayer.mlp.up_proj.weight": r(I, H), "midlayer.mlp.down_proj.weight": r(H, I),
         "midlayer.input_layernorm.weight": 1 + r(H), "midlayer.hidden_norm.weight": 1 + r(H),
         "midlayer.post_attention_layernorm.weight": 1 + r(H), "norm.weight": 1 + r(H), "lm_head.weight": r(Vd, H),
         "d2t": d2t - torch.arange(Vd), "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, d2t, True)}
    out.mkdir(parents=True)
    save_file(w, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "max_position_embeddings": max_positions, "vocab_size": V,
        "draft_vocab_size": Vd, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}}))
    return out


def make_drafts_free(llm, monkeypatch) -> None:
    """The draft policy's cost model pinned to free drafts and verify rows, so that "auto" drafts whatever the
    CPU measured at start-up (a chi-square test of "auto" needs drafts; on a fast CPU a tiny random drafter
    would rightly get none)."""
    import numpy as np
    costs = llm.engine.policy.costs
    monkeypatch.setattr(costs, "seconds", np.full_like(costs.seconds, 0.01))
    for name in ("per_draft_call", "per_draft_step", "per_draft_seq", "per_draft_token", "per_catch_up_seq",
                 "per_catch_up_token", "per_row_slot", "per_chain_row_slot", "narrow_row_slot",
                 "narrow_chain_row_slot"):
        monkeypatch.setattr(costs, name, 0.0)
    for name in ("observe_target", "observe_drafting"):
        monkeypatch.setattr(type(costs), name, lambda self, *args: None)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", tie_word_embeddings=False,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
