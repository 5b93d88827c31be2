"""GGUF import: every tensor type round trips to gguf's own dequantization, llama.cpp's Q/K permutation is
undone, logits equal transformers' on the dequantized weights, and what is not supported is a named error."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import CHATML, write_tokenizer
from gguf_files import F, llama_cpp_permute, write_gguf
from specserve.cli import main
from specserve.gguf.cache import file_sha256
from specserve.gguf.convert import convert, converted_dir
from specserve.llm import LLM
from specserve.models.registry import load_model
from specserve.sampling_params import SamplingParams

ROUND_TRIP_TYPES = [F.F32, F.F16, F.BF16, F.Q8_0, F.Q4_0, F.Q4_1, F.Q4_K, F.Q6_K]


def checkpoint(out, arch: str, hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
               tie: bool = False, seed: int = 0):
    """A random transformers checkpoint whose norms and biases are random too (their init is ones / zeros,
    which would hide a swapped or dropped tensor)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=400, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tie, eos_token_id=2, bos_token_id=None)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=head_dim or 32, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_tokenizer(out, 400)
    return out


@pytest.fixture(scope="module")
def llama_256(tmp_path_factory):
    """Rows of 256: the K-quants' block size."""
    return checkpoint(tmp_path_factory.mktemp("llama256"), "llama", hidden=256, heads=4, kv_heads=2)


@pytest.mark.parametrize("qtype", ROUND_TRIP_TYPES, ids=lambda q: q.name)
def test_every_tensor_round_trips_to_the_dequantized_values(llama_256, tmp_path, qtype):
    path, reference = write_gguf(llama_256, tmp_path / "m.gguf", "llama", qtype)
    out = convert(path, tmp_path / "hf", torch.float32)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(reference)
    for name, values in reference.items():
        assert torch.equal(weights[name], values), name
    if qtype != F.F32:   # the file really is quantized: its values are not the checkpoint's
        original = load_file(str(llama_256 / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
        assert not torch.equal(reference["model.layers.0.mlp.up_proj.weight"], original)


def test_written_folder_has_the_hugging_face_layout(llama_256, tmp_path):
    path, _ = write_gguf(llama_256, tmp_path / "m.gguf", "llama", F.Q8_0, bos=1, chat_template=CHATML)
    assert main(["convert", str(path), str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    config = json.loads((out / "config.json").read_text())
    original = json.loads((llama_256 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert config[key] == original[key], key
    assert config["rope_theta"] == 50000.0
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / "model.safetensors")).values())
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHATML
    assert (tok_config["eos_token"], tok_config["bos_token"]) == ("<|im_end|>", "<|im_start|>")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    assert (out / "tokenizer.json").is_file()
    assert main(["convert", str(path), str(tmp_path / "f16"), "--dtype", "float16"]) == 0
    assert all(t.dtype == torch.float16 for t in load_file(str(tmp_path / "f16" / "model.safetensors")).values())
    with pytest.raises(SystemExit):
        main(["convert", str(path), str(tmp_path / "x"), "--dtype", "int8"])


def test_llama_qk_permutation_is_undone(tmp_path):
    """Grouped-query heads (8 q, 2 kv): Q and K are permuted with different head counts. The file's rows
    are not the checkpoint's, so converting without the inverse permutation fails this test."""
    hf = checkpoint(tmp_path / "hf", "llama", hidden=128, heads=8, kv_heads=2)
    path, _ = write_gguf(hf, tmp_path / "m.gguf", "llama", F.F32)
    original = load_file(str(hf / "model.safetensors"))
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    for gguf_name, hf_name, n_head in (("attn_q", "q_proj", 8), ("attn_k", "k_proj", 2)):
        w = original[f"model.layers.0.self_attn.{hf_name}.weight"]
        assert not np.array_equal(stored[f"blk.0.{gguf_name}.weight"], w.numpy())
        assert np.array_equal(stored[f"blk.0.{gguf_name}.weight"], llama_cpp_permute(w.numpy(), n_head))
    converted = load_file(str(convert(path, tmp_path / "out", torch.float32) / "model.safetensors"))
    for name, w in original.items():
        assert torch.equal(converted[name], w), name
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])
    ours = load_model(tmp_path / "out", torch.float32)
    hidden, _ = ours(ids, torch.arange(ids.shape[1])[None])
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(ours.compute_logits(hidden), ref, rtol=1e-4, atol=1e-4)


ARCH_CASES = [("llama", F.Q8_0, {}), ("llama", F.Q4_K, {"hidden": 256}), ("qwen2", F.Q4_1, {"tie": True}),
              ("qwen3", F.Q6_K, {"hidden": 256, "head_dim": 64}), ("qwen3", F.BF16, {"tie": True})]


@pytest.mark.parametrize("arch,qtype,shape", ARCH_CASES, ids=[f"{a}-{q.name}" for a, q, _ in ARCH_CASES])
def test_logits_and_greedy_text_equal_transformers_on_the_dequantized_weights(tmp_path, arch, qtype, shape):
    hf = checkpoint(tmp_path / "hf", arch, **shape)
    path, reference = write_gguf(hf, tmp_path / "m.gguf", arch, qtype)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    missing, unexpected = ref_model.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ref_model.tie_weights()
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 300, 11]])
    ref_logits = ref_model(ids).logits
    ours = load_model(convert(path, tmp_path / "out", torch.float32), torch.float32)
    hidden, _ = ours(ids, torch.arange(ids.shape[1])[None])
    torch.testing.assert_close(ours.compute_logits(hidden), ref_logits, rtol=1e-4, atol=1e-4)
    llm = LLM(str(path), dtype="float32", speculative_method="none", kv_cache_memory_gb=0.01)   # the file itself
    out = llm.generate([ids[0].tolist()], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    expected = ref_model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.outputs[0].token_ids == expected[0, ids.shape[1]:].tolist()


def test_conversion_is_cached_by_sha256(llama_256, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = write_gguf(llama_256, tmp_path / "m.gguf", "llama", F.Q8_0)
    first = converted_dir(path)
    assert first.name.startswith(file_sha256(path)) and (first / "model.safetensors").is_file()
    import specserve.gguf.convert as convert_module
    monkeypatch.setattr(convert_module, "convert", lambda *a, **k: pytest.fail("converted twice"))
    assert converted_dir(path) == first
    copy = tmp_path / "copy.gguf"                      # another name, the same bytes: the same conversion
    copy.write_bytes(path.read_bytes())
    assert converted_dir(copy) == first


def test_sha256_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    digest = file_sha256(path)
    assert digest == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    index = tmp_path / "cache" / "sha256.json"
    known = json.loads(index.read_text())
    index.write_text(json.dumps({key: "remembered" for key in known}))
    assert file_sha256(path) == "remembered"           # not hashed again
    path.write_bytes(b"abcd")                          # new size (and mtime): hashed again
    assert file_sha256(path) == "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589"


def write_raw_gguf(path, arch="llama", tensors=None, pre: str | None = "gpt2", model="gpt2"):
    """A minimal file for the error cases: metadata plus the given (name, array, raw type) tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", 64), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("block_count", 1), ("attention.head_count", 2), ("attention.head_count_kv", 2)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    for name, data, raw in tensors or [("token_embd.weight", np.zeros((3, 32), np.float32), None)]:
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_tensor_type_and_pre_tokenizer_are_named_errors(tmp_path):
    with pytest.raises(ValueError, match="architecture 'gemma2'"):
        convert(write_raw_gguf(tmp_path / "a.gguf", arch="gemma2"), tmp_path / "a")
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery-bpe'"):
        convert(write_raw_gguf(tmp_path / "p.gguf", pre="mystery-bpe"), tmp_path / "p")
    with pytest.raises(ValueError, match="names no pre-tokenizer"):
        convert(write_raw_gguf(tmp_path / "none.gguf", pre=None), tmp_path / "none")
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        convert(write_raw_gguf(tmp_path / "t.gguf", model="llama"), tmp_path / "t")
    q8_1 = np.zeros((3, gguf.GGML_QUANT_SIZES[F.Q8_1][1]), np.uint8)   # a block per row; gguf.quants has no dequantizer
    with pytest.raises(ValueError, match="token_embd.weight has type Q8_1"):
        convert(write_raw_gguf(tmp_path / "q.gguf", tensors=[("token_embd.weight", q8_1, F.Q8_1)]), tmp_path / "q")
    fused = [("token_embd.weight", np.zeros((3, 32), np.float32), None),
             ("blk.0.attn_qkv.weight", np.zeros((96, 32), np.float32), None)]
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_qkv.weight'"):
        convert(write_raw_gguf(tmp_path / "n.gguf", tensors=fused), tmp_path / "n")
    assert not (tmp_path / "a").exists() or not (tmp_path / "a" / "model.safetensors").exists()


def test_a_bad_file_is_a_one_line_cli_error(tmp_path, capsys):
    bad = write_raw_gguf(tmp_path / "bad.gguf", arch="gemma2")
    assert main(["generate", "--model", str(bad), "--prompt", "hi"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "unsupported GGUF architecture 'gemma2'" in last
    assert main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 2
    assert "missing.gguf is not a GGUF file" in capsys.readouterr().err
    not_gguf = tmp_path / "weights.bin"
    save_file({"x": torch.zeros(2)}, str(not_gguf))
    assert main(["convert", str(not_gguf), str(tmp_path / "o")]) == 2
    assert "weights.bin is not a GGUF file" in capsys.readouterr().err
    assert main(["generate", "--model", str(not_gguf), "--prompt", "hi"]) == 2
    assert "weights.bin is a file but not a GGUF file" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err


def test_generate_and_serve_take_a_gguf_file(llama_256, tmp_path, capsys):
    import argparse
    from specserve.cli_args import engine_config_from_args
    from specserve.server.cli import add_serve_parser, resolve_serve_args
    path, _ = write_gguf(llama_256, tmp_path / "m.gguf", "llama", F.Q4_0, chat_template=CHATML)
    assert main(["generate", "--model", str(path), "--prompt", "def f(x):", "--max-tokens", "5", "--ignore-eos",
                 "--json", "--speculative-method", "ngram", "--kv-cache-memory-gb", "0.01"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 5 and out["speculative_method"] == "ngram"
    parser = argparse.ArgumentParser(prog="specserve")
    serve = add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = resolve_serve_args(parser.parse_args(["serve", str(path)]), serve)
    assert args.served_model_name is None                  # the server reports MODEL as given
    assert engine_config_from_args(args).model == converted_dir(path)
