"""`specserve train draft`: a small Llama draft model distilled from a target's recorded logits.

The draft shares the target's tokenizer and vocabulary. Its tied embedding starts as the target's embedding
projected on its top principal directions (so similar tokens start close), its layers from scratch. It
learns the target's next-token distribution, restricted to the recorded top-k and renormalised, at every
position of the recorded conversations (`specserve train data`); prompt positions weigh less than answers.
Saved as a Hugging Face LlamaForCausalLM folder (config, safetensors, tokenizer, generation config).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models import llama
from specserve.models.config import ModelConfig
from specserve.models.loader import save_safetensors, unpacked_state_dict
from specserve.models.registry import load_model, parse_dtype
from specserve.train.data import Conversations, load_conversations
from specserve.train.lm import DTYPE_NAMES, num_params
from specserve.train.trainer import StageConfig, add_device_argument, continued_from, train_stage
from specserve.train.token_map import DEFAULT_TOKEN_MAP_SIZE, write_data_token_map

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(slots=True)
class DraftTrainConfig:
    target: Path
    data: Path
    out: Path
    hidden_size: int = 192
    num_layers: int = 2
    num_heads: int = 3
    num_kv_heads: int = 1
    intermediate_size: int = 512
    head_dim: int = 64
    minutes: float = 15.0
    max_steps: int | None = None
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    prompt_weight: float = 0.3
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    resume: bool = False
    init: Path | None = None              # a saved draft model to continue training (its shape, not the flags')
    token_map_size: int = DEFAULT_TOKEN_MAP_SIZE   # token_map.json beside the weights (0: none)
    device: str = "cpu"


def draft_config(cfg: DraftTrainConfig, target: ModelConfig) -> dict:
    """A config.json that specserve and transformers' LlamaForCausalLM both load."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": target.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta, "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": target.bos_token_id, "eos_token_id": target.eos_token_id, "use_cache": True,
        "torch_dtype": DTYPE_NAMES[cfg.dtype],
    }


def new_draft(config: dict, target: nn.Module, seed: int) -> llama.LlamaForCausalLM:
    torch.manual_seed(seed)
    draft = llama.LlamaForCausalLM(ModelConfig.from_dict(config))
    residual_std = 0.02 / math.sqrt(2 * config["num_hidden_layers"])
    for name, param in draft.named_parameters():
        if param.dim() >= 2:
            nn.init.normal_(param, std=residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)
    with torch.no_grad():
        embed = target.model.embed_tokens.weight.float()                            # [V, H_target]
        _, _, v = torch.linalg.svd(embed, full_matrices=False)                      # principal directions
        projected = embed @ v[:config["hidden_size"]].T                             # [V, H_draft]
        draft.model.embed_tokens.weight.copy_(projected * (0.05 / projected.std()))   # logits start near uniform
    return draft


def distill_loss(draft: nn.Module, data: Conversations, rows: torch.Tensor, prompt_weight: float) -> torch.Tensor:
    """Cross-entropy of the draft against the target's top-k distribution (renormalised) after each token of
    windows rows [B, T + 1] of the recorded conversations."""
    rows = rows[:, :-1]
    hidden, _ = draft(data.input_ids[rows], torch.arange(rows.shape[1], device=rows.device))
    log_q = F.log_softmax(draft.compute_logits(hidden).float(), dim=-1)             # [B, T, V]
    p = torch.softmax(data.topk_logits[rows], dim=-1)                               # [B, T, K]
    ce = -(p * log_q.gather(-1, data.topk_ids[rows])).sum(-1)                       # [B, T]
    weight = torch.where(data.trainable[rows], 1.0, prompt_weight)
    return (ce * weight).sum() / weight.sum()


@torch.no_grad()
def greedy_agreement(draft: nn.Module, data: Conversations, rows: torch.Tensor) -> float:
    """How often the draft's argmax equals the target's at answer positions of the given windows."""
    rows = rows[:, :-1]
    hidden, _ = draft(data.input_ids[rows], torch.arange(rows.shape[1], device=rows.device))
    same = draft.compute_logits(hidden).argmax(-1) == data.topk_ids[rows, 0]
    mask = data.trainable[rows]
    return float(same[mask].float().mean()) if mask.any() else float("nan")


def save_draft(draft: nn.Module, config: dict, target_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_safetensors(unpacked_state_dict(draft, llama.PACKED), out / "model.safetensors",
                     parse_dtype(config["torch_dtype"]))
    for name in COPIED_FILES:
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, out / name)


def run_draft_training(cfg: DraftTrainConfig) -> dict:
    target_config = ModelConfig.from_pretrained(cfg.target)
    target = load_model(cfg.target, torch.float32, cfg.device, target_config)
    data = load_conversations(cfg.data, device=cfg.device, skip=("aux", "final"))
    if cfg.init is None:
        config = draft_config(cfg, target_config)
        draft = new_draft(config, target, cfg.seed).to(cfg.device)
    else:
        config = json.loads((cfg.init / "config.json").read_text())
        draft = load_model(cfg.init, torch.float32, cfg.device).requires_grad_(True)
    del target
    stage = StageConfig("draft", cfg.minutes, cfg.max_steps, cfg.batch_size, cfg.seq_len, cfg.lr, seed=cfg.seed,
                        device=cfg.device)
    rows = torch.arange(data.num_tokens, dtype=torch.int32)
    state = train_stage(stage, draft, lambda batch: distill_loss(draft, data, batch, cfg.prompt_weight), rows,
                        cfg.out / ".ckpt" / "draft.safetensors", cfg.resume)
    save_draft(draft, config, cfg.target, cfg.out)
    (cfg.out / ".gitignore").write_text(".ckpt/\n")
    summary = {"target": str(cfg.target), "data": str(cfg.data), "params": num_params(draft),
               "steps": state.step, "seconds": state.seconds, "minutes": state.seconds / 60,
               "tokens_per_step": cfg.batch_size * cfg.seq_len, "data_tokens": data.num_tokens,
               "answer_tokens": int(data.trainable.sum()), "token_positions_trained": state.step * cfg.batch_size * cfg.seq_len,
               "first_loss": sum(state.losses[:10]) / max(1, len(state.losses[:10])),
               "final_loss": sum(state.losses[-50:]) / max(1, len(state.losses[-50:])),
               "lr": cfg.lr, "prompt_weight": cfg.prompt_weight, "seed": cfg.seed}
    summary |= continued_from(cfg.init)
    summary |= write_data_token_map(data, cfg.token_map_size, target_config.vocab_size, cfg.out)
    (cfg.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def add_draft_parser(subparsers: argparse._SubParsersAction) -> None:
    d = DraftTrainConfig(Path("."), Path("."), Path("."))
    p = subparsers.add_parser("draft", help="distill a small Llama draft model from a target's recorded logits",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, default=None, help="the target model folder (default: the default model)")
    p.add_argument("--data", type=Path, required=True, help="conversations recorded by `specserve train data`")
    p.add_argument("--out", type=Path, required=True)
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "head_dim",
                 "batch_size", "seq_len"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--max-steps", type=int, default=None, help="fixed steps instead of the time budget")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--prompt-weight", type=float, default=d.prompt_weight)
    p.add_argument("--dtype", default="bfloat16", help="dtype of the saved weights")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue from OUT/.ckpt")
    p.add_argument("--init", type=Path, default=None,
                   help="continue training the draft model saved in this folder (its shape replaces the size flags)")
    p.add_argument("--token-map-size", type=int, default=d.token_map_size,
                   help="write token_map.json: the draft model scores this many of the data's most predicted tokens (0: all)")
    add_device_argument(p)
    p.set_defaults(func=run_draft_command)


def run_draft_command(args: argparse.Namespace) -> None:
    from specserve.train.data import default_target
    cfg = DraftTrainConfig(target=args.target or default_target(), data=args.data, out=args.out,
                           hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
                           num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
                           head_dim=args.head_dim, minutes=args.minutes, max_steps=args.max_steps,
                           batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                           prompt_weight=args.prompt_weight, dtype=parse_dtype(args.dtype), seed=args.seed,
                           resume=args.resume, init=args.init, token_map_size=args.token_map_size, device=args.device)
    print(json.dumps(run_draft_training(cfg), indent=2))
