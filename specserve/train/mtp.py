"""`specserve train mtp`: MTP layers for a frozen target, written in the DeepSeek-V3 layout.

Layer d at slot s reads token s and the previous layer's output at slot s - 1 (the target's hidden state
for d = 0), so it sees the target's state d + 1 tokens back; its label is the target's own next-token
distribution at slot s (KL(p || q), p the target's), the target's next token d + 1 steps past the state it
read. Inputs are corpus text with the target's held-out documents left out.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from specserve.models.config import ModelConfig
from specserve.models.mtp import MultiTokenPredictor, load_mtp, save_mtp_folder, save_mtp_into_checkpoint, shift_right
from specserve.models.registry import load_model, parse_dtype
from specserve.train import evaluate
from specserve.train.corpus import Corpus, build_corpus, default_sources, split_file
from specserve.train.data import Conversations, load_conversations
from specserve.train.demo import chat_texts, encode_documents
from specserve.train.trainer import StageConfig, add_device_argument, continued_from, train_stage
from specserve.train.token_map import DEFAULT_TOKEN_MAP_SIZE, write_data_token_map


@dataclass(slots=True)
class MTPTrainConfig:
    target: Path
    out: Path | None = None               # None: into the target's own checkpoint
    num_layers: int = 1
    minutes: float = 8.0
    max_steps: int | None = None
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    reuse_steps: int = 0                  # extra steps of the last layer on its own output, in the loss
    sources: list[Path] = field(default_factory=default_sources)
    max_corpus_mb: float = 8.0
    heldout_fraction: float = 0.03        # the demo trainer's: the same documents are held out
    device: str = "cpu"
    chat_fraction: float = 0.05
    eval_windows: int = 32
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    resume: bool = False
    data: Path | None = None              # recorded conversations (`specserve train data`) instead of a corpus
    prompt_weight: float = 0.3            # with data: loss weight of a prompt position (answer positions: 1)
    init: Path | None = None              # saved MTP layers to continue training (their number, not --layers)
    token_map_size: int = DEFAULT_TOKEN_MAP_SIZE   # with data: token_map.json beside the layers (0: none)


def init_mtp(target: torch.nn.Module, num_layers: int, seed: int) -> MultiTokenPredictor:
    """Each layer starts as a copy of the target's last decoder layer behind a random eh_proj (on the demo
    target this learns faster than eh_proj = [I | I], and as fast as a fresh layer)."""
    torch.manual_seed(seed)
    mtp = MultiTokenPredictor(target.config, num_layers)
    last = target.model.layers[target.config.num_hidden_layers - 1].state_dict()
    for layer in mtp.layers:
        layer.load_state_dict(last, strict=False)
        torch.nn.init.normal_(layer.eh_proj.weight, std=0.02)
    return mtp


def mtp_outputs(mtp: MultiTokenPredictor, target: torch.nn.Module, input_ids: torch.Tensor,
                reuse_steps: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Target logits [B, T, V] (no grad) and each MTP layer's logits, cache-free over whole windows, then
    reuse_steps more of the last layer reading its own output (as drafting past N does, though there
    only the last slots read it)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    with torch.no_grad():
        hidden, _ = target(input_ids, positions)                                  # [B, T, H]
        target_logits = target.compute_logits(hidden).float()
        embeds = target.model.embed_tokens(input_ids)
        embeds[:, 0] = 0                                                          # slot 0 reads nothing
    logits = []
    for depth in range(mtp.num_layers + reuse_steps):
        layer = min(depth, mtp.num_layers - 1)
        hidden = mtp(layer, embeds, shift_right(hidden), positions)
        logits.append(mtp.compute_logits(layer, hidden, target).float())
    return target_logits, logits


def stored_mtp_loss(mtp: MultiTokenPredictor, target: torch.nn.Module, data: Conversations, rows: torch.Tensor,
                    reuse_steps: int, prompt_weight: float, reuse_weight: float = 0.5) -> torch.Tensor:
    """mtp_loss on windows rows [B, T + 1] of recorded conversations: the target's final states are the
    recorded ones, its next-token distribution the recorded top-k, renormalised (cross-entropy)."""
    rows = rows[:, :-1]
    positions = torch.arange(rows.shape[1], device=rows.device)
    with torch.no_grad():
        hidden = data.final[rows].float()
        embeds = target.model.embed_tokens(data.input_ids[rows])
        embeds[:, 0] = 0
        p = torch.softmax(data.topk_logits[rows], dim=-1)                                  # [B, T, K]
        weight = torch.where(data.trainable[rows], 1.0, prompt_weight)
    total = 0.0
    for depth in range(mtp.num_layers + reuse_steps):
        layer = min(depth, mtp.num_layers - 1)
        hidden = mtp(layer, embeds, shift_right(hidden), positions)
        log_q = F.log_softmax(mtp.compute_logits(layer, hidden, target).float(), dim=-1)
        ce = -(p * log_q.gather(-1, data.topk_ids[rows])).sum(-1)
        total = total + (1.0 if depth < mtp.num_layers else reuse_weight) * (ce * weight).sum() / weight.sum()
    return total


def mtp_loss(mtp: MultiTokenPredictor, target: torch.nn.Module, batch: torch.Tensor, reuse_steps: int = 0,
             reuse_weight: float = 0.5) -> torch.Tensor:
    """Sum over layers of KL(p || q) against the target's next-token distribution at the same slot; the
    reuse steps weigh reuse_weight each."""
    target_logits, logits = mtp_outputs(mtp, target, batch[:, :-1], reuse_steps)
    log_p = F.log_softmax(target_logits, dim=-1).flatten(0, 1)
    weights = [1.0] * mtp.num_layers + [reuse_weight] * reuse_steps
    return sum(w * F.kl_div(F.log_softmax(q, dim=-1).flatten(0, 1), log_p, log_target=True, reduction="batchmean")
               for w, q in zip(weights, logits))


@torch.no_grad()
def agreement(mtp: MultiTokenPredictor, target: torch.nn.Module, windows: torch.Tensor, reuse_steps: int = 0) -> list[float]:
    """Per layer (then per reuse step), on held-out windows: how often its argmax equals the target's at
    the same slot."""
    same, count = [0.0] * (mtp.num_layers + reuse_steps), 0
    for chunk in windows.split(8):
        chunk = chunk.to(target.model.embed_tokens.weight.device)
        target_logits, logits = mtp_outputs(mtp, target, chunk[:, :-1], reuse_steps)
        top = target_logits.argmax(-1)
        for layer, q in enumerate(logits):
            same[layer] += (q.argmax(-1) == top).sum().item()
        count += top.numel()
    return [s / count for s in same]


def training_tokens(cfg: MTPTrainConfig, tokenizer: Tokenizer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Training token ids and held-out ones: the documents the target's heldout.json names, when it has one."""
    corpus = build_corpus(cfg.sources, cfg.heldout_fraction, int(cfg.max_corpus_mb * 1e6), cfg.seed)
    heldout_path = cfg.target / "heldout.json"
    if heldout_path.exists():
        entries = json.loads(heldout_path.read_text())
        named = {(e["path"], e["chunk"]) for e in entries}
        corpus = Corpus([d for d in corpus.train if (d.path, d.chunk) not in named],
                        [d for e in entries if Path(e["path"]).exists()
                         for d in split_file(Path(e["path"]), e["name"].split("#")[0]) if d.chunk == e["chunk"]])
    texts = [d.text for d in corpus.train] + chat_texts(corpus, cfg.chat_fraction, cfg.seed)
    heldout = encode_documents(tokenizer, [d.text for d in corpus.heldout]) if corpus.heldout else None
    return encode_documents(tokenizer, texts), heldout


def run_mtp_training(cfg: MTPTrainConfig) -> dict:
    out_dir = cfg.out or cfg.target
    target = load_model(cfg.target, torch.float32, cfg.device).requires_grad_(False)
    if cfg.init is None:
        mtp = init_mtp(target, cfg.num_layers, cfg.seed).to(cfg.device)
    else:
        mtp = load_mtp(cfg.init, target.config, device=cfg.device).requires_grad_(True).train()
        cfg.num_layers = mtp.num_layers
    stage = StageConfig("mtp", cfg.minutes, cfg.max_steps, cfg.batch_size, cfg.seq_len, cfg.lr, seed=cfg.seed,
                        device=cfg.device)
    if cfg.data is None:
        tokens, heldout = training_tokens(cfg, Tokenizer.from_file(str(cfg.target / "tokenizer.json")))
        loss_fn = lambda batch: mtp_loss(mtp, target, batch, cfg.reuse_steps)
    else:
        data, heldout = load_conversations(cfg.data, device=cfg.device, skip=("aux",)), None
        tokens = torch.arange(data.num_tokens, dtype=torch.int32)
        loss_fn = lambda rows: stored_mtp_loss(mtp, target, data, rows, cfg.reuse_steps, cfg.prompt_weight)
    state = train_stage(stage, mtp, loss_fn, tokens, out_dir / ".ckpt" / "mtp.safetensors", cfg.resume)
    if cfg.out is None:
        save_mtp_into_checkpoint(mtp, cfg.target, cfg.dtype)
    else:
        save_mtp_folder(mtp, cfg.target, cfg.out, cfg.dtype)
    # measured on the shipped weights, loaded back as the server loads them
    shipped = load_mtp(out_dir, target.config, device=cfg.device)
    summary = {"num_layers": cfg.num_layers, "reuse_steps": cfg.reuse_steps, "steps": state.step,
               "train_seconds": state.seconds, "minutes": state.seconds / 60, "train_tokens": len(tokens),
               "tokens_per_step": cfg.batch_size * cfg.seq_len,
               "first_loss": _mean(state.losses[:10]), "last_loss": _mean(state.losses[-50:])}
    if cfg.data is not None:
        summary |= {"data": str(cfg.data), "answer_tokens": int(data.trainable.sum()), "prompt_weight": cfg.prompt_weight}
        summary |= write_data_token_map(data, cfg.token_map_size, target.config.vocab_size, out_dir)
    summary |= continued_from(cfg.init)
    if heldout is not None and len(heldout) > cfg.seq_len + 1:
        windows = evaluate.windows(heldout, cfg.seq_len, cfg.eval_windows)
        summary["heldout_greedy_agreement_per_depth"] = agreement(shipped, target, windows, max(2, cfg.reuse_steps))
    summary_name = "training_summary.json" if cfg.data is not None else "mtp_training_summary.json"
    summary_path = (cfg.out or cfg.target / ".ckpt") / summary_name
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def add_mtp_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = MTPTrainConfig(Path("."))
    p = subparsers.add_parser("mtp", help="train MTP layers for a frozen target (DeepSeek-V3 layout)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="the target model folder")
    p.add_argument("--layers", type=int, default=defaults.num_layers, help="number of MTP layers")
    p.add_argument("--out", type=Path, default=None,
                   help="write the layers to this folder (config.json + model.safetensors) instead of into "
                        "the target's checkpoint")
    p.add_argument("--minutes", type=float, default=defaults.minutes)
    p.add_argument("--max-steps", type=int, default=None, help="fixed steps instead of the time budget")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--reuse-steps", type=int, default=defaults.reuse_steps,
                   help="also train the last layer on this many steps of reading its own output")
    p.add_argument("--corpus", type=Path, nargs="+", default=None,
                   help="text files or folders (default: the demo corpus)")
    p.add_argument("--max-corpus-mb", type=float, default=defaults.max_corpus_mb)
    p.add_argument("--dtype", default="bfloat16", help="dtype of the saved weights")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--resume", action="store_true", help="continue from the .ckpt folder")
    p.add_argument("--init", type=Path, default=None,
                   help="continue training the MTP layers saved in this folder (their number replaces --layers)")
    p.add_argument("--data", type=Path, default=None,
                   help="train on the conversations recorded by `specserve train data` instead of a corpus")
    p.add_argument("--prompt-weight", type=float, default=defaults.prompt_weight,
                   help="with --data: loss weight of prompt positions (answer positions weigh 1)")
    p.add_argument("--token-map-size", type=int, default=defaults.token_map_size,
                   help="with --data: write token_map.json, the layers then score this many of the data's most "
                        "predicted tokens (0: all)")
    add_device_argument(p)
    p.set_defaults(func=run_mtp_command)


def run_mtp_command(args: argparse.Namespace) -> None:
    if args.layers < 1:
        raise SystemExit("error: --layers must be >= 1")
    ModelConfig.from_pretrained(args.target)          # a clear error for a folder without config.json
    cfg = MTPTrainConfig(target=args.target, out=args.out, num_layers=args.layers, minutes=args.minutes,
                         max_steps=args.max_steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                         reuse_steps=args.reuse_steps,
                         max_corpus_mb=args.max_corpus_mb, dtype=parse_dtype(args.dtype), seed=args.seed,
                         resume=args.resume, data=args.data, prompt_weight=args.prompt_weight, init=args.init,
                         token_map_size=args.token_map_size, device=args.device)
    if args.corpus:
        cfg.sources = args.corpus
    start = time.monotonic()
    summary = run_mtp_training(cfg)
    summary["wall_seconds"] = time.monotonic() - start
    print(json.dumps(summary, indent=2))
