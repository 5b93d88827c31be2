"""`specserve train eagle3`: an EAGLE3 head for any supported target, saved in the published layout.

Stages: corpus (the target's held-out documents left out) -> draft vocabulary (the target's most
frequent next tokens, d2t/t2d) -> head training. Each batch runs the frozen target to get the three
layers' states and its own next-token distributions, then trains the head with training-time test:
the head is unrolled `ttt_steps` times on its own outputs, step s at position i standing for the
draft s tokens after the context ending at i, and learns the target's distribution over the draft
vocabulary at every step (where the target's own next token is in it, as EAGLE3 does).
"""
from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn
from tqdm import tqdm

from specserve.models.config import ModelConfig
from specserve.models.eagle3 import (ARCHITECTURE, Eagle3Config, Eagle3Head, load_eagle3_head, resolve_aux_layers,
                                     save_eagle3_head)
from specserve.models.registry import load_model, parse_dtype
from specserve.train.checkpoint import load_state, save_state
from specserve.train.corpus import Corpus, default_sources, read_source
from specserve.train.data import Conversations, load_conversations, segment_ids
from specserve.train.demo import chat_texts
from specserve.train.trainer import StageConfig, add_device_argument, continued_from, sample_batch, train_stage
from specserve.train.token_map import frequent_tokens, ranked_tokens


DRAFT_VOCAB_SIZE = 2048


@dataclass(slots=True)
class Eagle3TrainConfig:
    target: Path
    out: Path | None = None                 # default: <target>/eagle3
    sources: list[Path] = field(default_factory=default_sources)
    minutes: float = 12.0
    max_steps: int | None = None
    draft_vocab_size: int | None = None   # a new head's: 2048 when None; with init, None keeps the saved head's
    intermediate_size: int | None = None    # default: the target's
    layers: tuple[int, ...] | None = None   # target layers whose input states the head reads; None: (2, L//2, L-3)
    init: Path | None = None                # a saved head to continue training (its layers and vocabulary)
    ttt_steps: int = 6
    step_weight: float = 0.8                # loss weight of unrolled step s: step_weight ** s
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    vocab_tokens: int = 100_000             # target predictions counted to pick the draft vocabulary
    max_corpus_mb: float = 16.0
    chat_fraction: float = 0.05
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    resume: bool = False
    data: Path | None = None                # recorded conversations (`specserve train data`) instead of a corpus
    prompt_weight: float = 0.3              # with data: loss weight of a prompt position (answer positions: 1)
    device: str = "cpu"

    @property
    def out_dir(self) -> Path:
        return self.out or self.target / "eagle3"


def run_eagle3_training(cfg: Eagle3TrainConfig) -> dict:
    ckpt = cfg.out_dir / ".ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    target_config = ModelConfig.from_pretrained(cfg.target)
    target = load_model(cfg.target, torch.float32, cfg.device, target_config).requires_grad_(False)
    data = load_conversations(cfg.data, device=cfg.device) if cfg.data is not None else None
    tokens = corpus_tokens(cfg, target_config) if data is None else torch.arange(data.num_tokens, dtype=torch.int32)
    if cfg.init is None:
        layers = resolve_aux_layers(None if cfg.layers is None else list(cfg.layers), target_config.num_hidden_layers)
        if data is None:
            draft_ids = draft_vocabulary(cfg, target, layers, tokens, ckpt / "vocab.safetensors")
        else:
            if tuple(layers) != data.aux_layers:
                raise ValueError(f"{cfg.data} recorded layers {list(data.aux_layers)}, the head reads {list(layers)}")
            draft_ids = frequent_tokens(data, min(cfg.draft_vocab_size or DRAFT_VOCAB_SIZE, target_config.vocab_size),
                                              target_config.vocab_size)
        head = new_head(cfg, target, target_config, draft_ids)
    else:   # continue training a saved head: its layers and draft vocabulary
        head = load_eagle3_head(cfg.init, target.model.embed_tokens, target_config, torch.float32, cfg.device,
                                cfg.seq_len + cfg.ttt_steps + 1).requires_grad_(True)
        head.embed_tokens.requires_grad_(False)
        layers = resolve_aux_layers(head.config.aux_layer_ids, target_config.num_hidden_layers)
        draft_ids = head.target_ids(torch.arange(head.config.draft_vocab_size, device=cfg.device)).cpu()
        if data is not None and cfg.draft_vocab_size is not None and cfg.draft_vocab_size != len(draft_ids):
            draft_ids = resize_draft_vocabulary(head, target, draft_ids, ranked_tokens(data, target_config.vocab_size),
                                                min(cfg.draft_vocab_size, target_config.vocab_size))
    head = head.to(cfg.device)
    stage = StageConfig("eagle3", cfg.minutes, cfg.max_steps, cfg.batch_size, cfg.seq_len, cfg.lr, seed=cfg.seed,
                        device=cfg.device)
    draft_index = torch.full((target_config.vocab_size,), -1, dtype=torch.int64)
    draft_index[draft_ids] = torch.arange(len(draft_ids))
    draft_index = draft_index.to(cfg.device)
    if data is None:
        loss_fn = lambda batch: ttt_loss(head, target, layers, draft_index, batch, cfg)
    else:
        segments, draft_weight = segment_ids(data), target.output_weight[draft_ids].float()
        loss_fn = lambda rows: stored_ttt_loss(head, data, segments, draft_index, draft_weight, rows, cfg)
    state = train_stage(stage, head, loss_fn, tokens, ckpt / "head.safetensors", cfg.resume)
    t2d = draft_index >= 0
    save_eagle3_head(head.cpu(), cfg.out_dir, cfg.dtype, t2d.cpu())
    summary = {"target": str(cfg.target), "target_layers_read": list(layers), "draft_vocab_size": len(draft_ids),
               "train_tokens": len(tokens), "steps": state.step, "seconds": state.seconds,
               "minutes": state.seconds / 60, "ttt_steps": cfg.ttt_steps,
               "first_loss": sum(state.losses[:10]) / max(1, len(state.losses[:10])),
               "final_loss": sum(state.losses[-50:]) / max(1, len(state.losses[-50:])),
               "tokens_per_step": cfg.batch_size * cfg.seq_len, "lr": cfg.lr, "seed": cfg.seed,
               "intermediate_size": head.config.layer.intermediate_size}
    if data is not None:
        summary |= {"data": str(cfg.data), "answer_tokens": int(data.trainable.sum()), "prompt_weight": cfg.prompt_weight,
                    "token_positions_trained": state.step * cfg.batch_size * cfg.seq_len}
        coverage = (draft_index[data.topk_ids[data.trainable, 0]] >= 0).float().mean().item()
        summary["draft_vocab_coverage_of_answers"] = coverage
    summary |= continued_from(cfg.init)
    (cfg.out_dir / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def corpus_tokens(cfg: Eagle3TrainConfig, target_config: ModelConfig) -> torch.Tensor:
    """The corpus as token ids, documents separated by the target's BOS (else EOS) token. Documents the
    target's trainer held out (its heldout.json) are left out, so they stay held out for the head."""
    heldout_file = cfg.target / "heldout.json"
    heldout = {d["name"] for d in json.loads(heldout_file.read_text())} if heldout_file.exists() else set()
    docs = [d for source in cfg.sources for d in read_source(Path(source)) if d.name not in heldout]
    if not docs:
        raise ValueError(f"no training documents in {[str(s) for s in cfg.sources]}")
    rng = random.Random(cfg.seed)
    rng.shuffle(docs)
    kept, size = [], 0
    for doc in docs:
        if size + len(doc.text) <= cfg.max_corpus_mb * 1e6 or not kept:
            kept.append(doc)
            size += len(doc.text)
    multiline = [d for d in kept if d.text.count("\n") >= 6]     # chat examples are cut from lines
    texts = [d.text for d in kept] + (chat_texts(Corpus(multiline, []), cfg.chat_fraction, cfg.seed) if multiline else [])
    rng.shuffle(texts)
    tokenizer = Tokenizer.from_file(str(cfg.target / "tokenizer.json"))
    eos = target_config.eos_token_id
    separator = target_config.bos_token_id if target_config.bos_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        if separator is not None:
            ids.append(separator)
        ids.extend(encoding.ids)
    if len(ids) < cfg.seq_len + 2:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one training window ({cfg.seq_len + 1})")
    return torch.tensor(ids, dtype=torch.int32)


@torch.no_grad()
def target_states(target: nn.Module, layers: tuple[int, ...], batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated states the head reads [B, T, 3H] and the target's next-token logits [B, T, V]."""
    aux_layers = tuple(sorted(set(layers)))
    final, aux = target(batch, torch.arange(batch.shape[1], device=batch.device), None, aux_layers)
    states = torch.cat([aux[aux_layers.index(i)] for i in sorted(layers)], dim=-1)
    return states, target.compute_logits(final).float()


def draft_vocabulary(cfg: Eagle3TrainConfig, target: nn.Module, layers: tuple[int, ...], tokens: torch.Tensor,
                     cached: Path) -> torch.Tensor:
    """The draft_vocab_size target tokens the target predicts most often on the corpus, ascending
    (ties and any shortfall filled by corpus frequency, then by id)."""
    size = min(cfg.draft_vocab_size or DRAFT_VOCAB_SIZE, target.config.vocab_size)
    if cfg.resume and cached.exists():
        return load_state(cached)
    counts: Counter[int] = Counter()
    num_batches = max(1, cfg.vocab_tokens // (cfg.batch_size * cfg.seq_len))
    for step in tqdm(range(num_batches), desc="draft vocabulary", dynamic_ncols=True, mininterval=5.0):
        batch = sample_batch(tokens, cfg.batch_size, cfg.seq_len, cfg.seed + 7, step)
        with torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16):
            _, logits = target_states(target, layers, batch.to(cfg.device))
        counts.update(logits.argmax(-1).flatten().tolist())
    corpus = torch.bincount(tokens.long(), minlength=target.config.vocab_size).tolist()
    ranked = sorted(range(target.config.vocab_size), key=lambda t: (-counts.get(t, 0), -corpus[t], t))
    draft_ids = torch.tensor(sorted(ranked[:size]), dtype=torch.int64)
    covered = sum(counts.get(t, 0) for t in draft_ids.tolist()) / max(1, sum(counts.values()))
    print(f"draft vocabulary: {size} tokens cover {covered:.1%} of the target's predictions")
    save_state(cached, draft_ids)
    return draft_ids


def new_head(cfg: Eagle3TrainConfig, target: nn.Module, target_config: ModelConfig, draft_ids: torch.Tensor) -> Eagle3Head:
    """A head sized like one target layer; its lm_head and final norm start from the target's own rows
    for the draft vocabulary. The target's embedding is shared and frozen."""
    t = target_config
    layer = ModelConfig(architectures=[ARCHITECTURE], vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                        intermediate_size=cfg.intermediate_size or t.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                        head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
                        rope_scaling=t.rope_scaling, max_position_embeddings=t.max_position_embeddings,
                        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id)
    config = Eagle3Config(layer, draft_vocab_size=len(draft_ids), target_hidden_size=t.hidden_size,
                          aux_layer_ids=None if cfg.layers is None else list(cfg.layers))
    torch.manual_seed(cfg.seed)
    head = Eagle3Head(config, max_positions=cfg.seq_len + cfg.ttt_steps + 1)
    for name, param in head.named_parameters():
        if param.dim() >= 2:
            nn.init.normal_(param, std=0.02)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.output_weight[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        # fc starts by passing the last of the three states through, so that the head's hidden state starts
        # as a residual stream of the target's (its norm and lm_head are the target's)
        H = t.hidden_size
        head.fc.weight[:, 2 * H:] += torch.eye(H, dtype=head.fc.weight.dtype)
    head.embed_tokens = target.model.embed_tokens           # frozen with the target
    return head


def resize_draft_vocabulary(head: Eagle3Head, target: nn.Module, draft_ids: torch.Tensor, ranked: list[int],
                            size: int) -> torch.Tensor:
    """A saved head's draft vocabulary resized to `size` tokens: grown by the best-ranked tokens it lacks (a
    vocabulary chosen from other data covers less of this one), or cut to its best-ranked ones. Kept tokens keep
    their rows; a new token's lm_head row starts from the target's, as in a new head. Returns the new draft ids
    (ascending, as d2t maps them)."""
    have = set(draft_ids.tolist())
    if size < len(have):
        kept = set([t for t in ranked if t in have][:size])
    else:
        kept = have | set([t for t in ranked if t not in have][:size - len(have)])
    merged = torch.tensor(sorted(kept), dtype=torch.int64)
    old_row = {t: i for i, t in enumerate(draft_ids.tolist())}
    old = head.lm_head.weight.detach()
    rows = [old[old_row[t]] if t in old_row else target.output_weight[t].to(old.dtype) for t in merged.tolist()]
    head.lm_head = nn.Linear(old.shape[1], len(merged), bias=False, device=old.device)
    with torch.no_grad():
        head.lm_head.weight.copy_(torch.stack(rows))
    head.d2t = (merged - torch.arange(len(merged))).to(old.device)
    head.config.draft_vocab_size = len(merged)
    return merged


def ttt_loss(head: Eagle3Head, target: nn.Module, layers: tuple[int, ...], draft_index: torch.Tensor,
             batch: torch.Tensor, cfg: Eagle3TrainConfig) -> torch.Tensor:
    """Training-time test on a batch [B, T + 1] of corpus tokens, the target run on it here."""
    states, logits = target_states(target, layers, batch)                               # [B, T+1, 3H], [B, T+1, V]
    draft_ids = (draft_index >= 0).nonzero().squeeze(1)
    p = torch.softmax(logits[..., draft_ids], dim=-1)                                   # [B, T+1, Vd]
    valid = draft_index[logits.argmax(-1)] >= 0                                         # [B, T+1]
    return unrolled_loss(head, batch, states, p, valid.float(), None, cfg.ttt_steps, cfg.step_weight)


def stored_ttt_loss(head: Eagle3Head, data: Conversations, segments: torch.Tensor, draft_index: torch.Tensor,
                    draft_weight: torch.Tensor, rows: torch.Tensor, cfg: Eagle3TrainConfig) -> torch.Tensor:
    """Training-time test on windows of recorded conversations, rows [B, T + 1] indexing data's tokens. The
    target's distribution over the draft vocabulary comes from its recorded final hidden state (the exact
    logits of those tokens); a prompt position weighs prompt_weight, an answer position 1."""
    with torch.no_grad():
        p = torch.softmax(F.linear(data.final[rows].float(), draft_weight), dim=-1)     # [B, T+1, Vd]
        in_vocab = draft_index[data.topk_ids[rows, 0]] >= 0
        weight = torch.where(data.trainable[rows], 1.0, cfg.prompt_weight) * in_vocab   # [B, T+1]
    return unrolled_loss(head, data.input_ids[rows], data.aux[rows[:, :-1]], p, weight, segments[rows],
                         cfg.ttt_steps, cfg.step_weight)


def unrolled_loss(head: Eagle3Head, batch: torch.Tensor, states: torch.Tensor, p: torch.Tensor, weight: torch.Tensor,
                  segment: torch.Tensor | None, ttt_steps: int, step_weight: float) -> torch.Tensor:
    """Step s at position i takes token x[i+s+1] (with the target's states at i for s = 0, else the head's
    step s-1 output at i), sits at rotary position i+s, and learns the target's distribution p after x[i+s+1]
    over the draft vocabulary. weight [B, T+1] weighs each label (0: the target's argmax is outside the draft
    vocabulary); positions past the window, or (with segment ids) in another conversation than i, are masked."""
    B, T = batch.shape[0], batch.shape[1] - 1
    hidden = head.fc(states[:, :T])                                                     # [B, T, H]
    earlier, total, weights = [], 0.0, 0.0
    for s in range(min(ttt_steps, T)):
        tokens = torch.cat([batch[:, s + 1:], batch.new_zeros(B, s)], dim=1)            # [B, T]
        p_s = torch.cat([p[:, s + 1:], p.new_zeros(B, s, p.shape[-1])], dim=1)          # [B, T, Vd]
        w_s = torch.cat([weight[:, s + 1:], weight.new_zeros(B, s)], dim=1)             # [B, T]
        if segment is not None:
            same = torch.cat([segment[:, s + 1:] == segment[:, :T - s], segment.new_zeros(B, s, dtype=torch.bool)], dim=1)
            w_s = w_s * same
        hidden, kv = head.forward_unrolled(tokens, hidden, torch.arange(T, device=batch.device) + s, earlier)
        earlier.append(kv)
        log_q = torch.log_softmax(head.draft_logits(hidden).float(), dim=-1)
        loss = (-(p_s * log_q).sum(-1) * w_s).sum() / w_s.sum().clamp_min(1.0)
        total = total + step_weight ** s * loss
        weights += step_weight ** s
    return total / weights


def add_eagle3_parser(subparsers: argparse._SubParsersAction) -> None:
    d = Eagle3TrainConfig(target=Path("."))
    p = subparsers.add_parser("eagle3", help="train an EAGLE3 head for a target (saved in the published layout)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="the target model folder")
    p.add_argument("--corpus", type=Path, nargs="+", default=None,
                   help="text files or folders (default: this Python's standard library + tinyshakespeare)")
    p.add_argument("--out", type=Path, default=None, help="head folder (default: TARGET/eagle3)")
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--max-steps", type=int, default=None, help="fixed steps instead of the time budget")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help=f"draft vocabulary of a new head (default {DRAFT_VOCAB_SIZE}); with --init and --data, resizes "
                        "the saved head's: grown by the data's most predicted tokens it lacks, or cut to its most "
                        "predicted ones (default: kept)")
    p.add_argument("--intermediate-size", type=int, default=None, help="head MLP size (default: the target's)")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="unrolled training-time-test steps")
    p.add_argument("--layers", type=parse_layers, default=None,
                   help="three target layers whose INPUT states the head reads, e.g. 2,5,8 (8: the last layer's "
                        "output), the first >= 2; written to the config as capture-before ids (default: 2,L/2,L-3)")
    p.add_argument("--init", type=Path, default=None, help="continue training the head saved in this folder")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--vocab-tokens", type=int, default=d.vocab_tokens)
    p.add_argument("--max-corpus-mb", type=float, default=d.max_corpus_mb)
    p.add_argument("--dtype", default="bfloat16", help="dtype of the saved weights")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue from OUT/.ckpt")
    p.add_argument("--data", type=Path, default=None,
                   help="train on the conversations recorded by `specserve train data` instead of a corpus")
    p.add_argument("--prompt-weight", type=float, default=d.prompt_weight,
                   help="with --data: loss weight of prompt positions (answer positions weigh 1)")
    add_device_argument(p)
    p.set_defaults(func=run_eagle3_command)


def parse_layers(text: str) -> tuple[int, ...]:
    layers = tuple(int(x) for x in text.split(","))
    if len(layers) != 3 or layers[0] < 2:
        # a first id of 1 would read as SpecForge's layer-output convention (see resolve_aux_layers)
        raise argparse.ArgumentTypeError(f"--layers takes three layer indices, the first >= 2; got {text!r}")
    return layers


def run_eagle3_command(args: argparse.Namespace) -> None:
    cfg = Eagle3TrainConfig(target=args.target, out=args.out, minutes=args.minutes, max_steps=args.max_steps,
                            draft_vocab_size=args.draft_vocab_size, intermediate_size=args.intermediate_size,
                            ttt_steps=args.ttt_steps, layers=args.layers, init=args.init, batch_size=args.batch_size,
                            seq_len=args.seq_len, lr=args.lr,
                            vocab_tokens=args.vocab_tokens, max_corpus_mb=args.max_corpus_mb,
                            dtype=parse_dtype(args.dtype), seed=args.seed, resume=args.resume,
                            data=args.data, prompt_weight=args.prompt_weight, device=args.device)
    if args.corpus:
        cfg.sources = args.corpus
    print(json.dumps(run_eagle3_training(cfg), indent=2))
