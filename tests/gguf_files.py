"""GGUF files written by the tests with gguf.GGUFWriter, following llama.cpp's convert_hf_to_gguf conventions:
tensor names, metadata keys, Q/K rows permuted for the llama architecture, 1-D tensors kept in F32.

Everything here is written independently of specserve/gguf, so that the tests check it against the format.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

F = gguf.GGMLQuantizationType
HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
CONTROL, USER_DEFINED = 3, 4


def gguf_name(hf_name: str) -> str:
    module, leaf = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF_LAYER[rest]}.{leaf}"
    return f"{HF_TO_GGUF_GLOBAL[module]}.{leaf}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: each head's two rotary halves interleaved row by row."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K rows (gguf-py cannot quantize to these), with small finite fp16 scales in the
    fields ggml's block layouts put them: block_q4_K {half d, dmin; u8 scales[12]; u8 qs[128]},
    block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; half d}."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scales = lambda n: rng.uniform(5e-5, 1e-4, size=(blocks.shape[0], n)).astype(np.float16).view(np.uint8)
    if qtype == F.Q4_K:
        blocks[:, 0:4] = scales(2)
    elif qtype == F.Q6_K:
        blocks[:, -2:] = scales(1)
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, cols // block * size)


def encode(w: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """The tensor's data as stored in the file (float arrays for F32/F16, bytes for the rest)."""
    if qtype in (F.Q4_K, F.Q6_K):
        return random_k_blocks(w.shape[0], w.shape[1], qtype, rng)
    return gguf.quants.quantize(w, qtype)


def tokenizer_fields(model_dir: Path) -> dict:
    """A transformers tokenizer.json (byte-level BPE) as GGUF tokenizer metadata."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {"tokens": tokens, "types": [CONTROL if t in specials else 1 for t in tokens], "merges": merges}


def write_gguf(model_dir: Path, out: Path, arch: str, qtype=F.F32, tokenizer: dict | None = None, pre: str = "gpt2",
               eos: int = 2, bos: int | None = None, add_bos: bool | None = None, chat_template: str | None = None,
               seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """A GGUF file holding the Hugging Face checkpoint in model_dir, 2-D weights stored as qtype.

    Returns the file and the reference: every tensor under its Hugging Face name as the file's dequantized
    values (gguf.quants.dequantize of what was written, in Hugging Face row order)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or rope.get("rope_theta"))
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads or arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    tokenizer = tokenizer or tokenizer_fields(model_dir)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    w.add_token_merges(tokenizer["merges"])
    w.add_eos_token_id(eos)
    if bos is not None:
        w.add_bos_token_id(bos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)
    reference = {}
    for name, tensor in weights.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        data = tensor.float().numpy()
        kind = qtype if data.ndim == 2 else F.F32
        stored = encode(data, kind, rng)
        reference[name] = torch.from_numpy(np.array(gguf.quants.dequantize(stored, kind), dtype=np.float32))
        if arch == "llama" and ".q_proj." in name:
            stored = llama_cpp_permute(stored, heads)          # rows permute with their blocks
        elif arch == "llama" and ".k_proj." in name:
            stored = llama_cpp_permute(stored, kv_heads)
        if kind in (F.F32, F.F16):
            w.add_tensor(gguf_name(name), stored)
        else:
            w.add_tensor(gguf_name(name), stored, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out, reference
