"""`specserve train demo`: tokenizer, target and distilled draft trained from scratch, shipped in the HF layout.

Stages: data (corpus, tokenizer, token ids) -> target (next-token loss) -> draft (KL to the target's
logits) -> evaluate. Each stage checkpoints to <out>/.ckpt/; with resume, finished stages are skipped.
"""
from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from specserve.models.registry import load_model
from specserve.train import evaluate
from specserve.train.checkpoint import load_state, save_state
from specserve.train.corpus import Corpus, Document, build_corpus, chat_examples, default_sources
from specserve.train.lm import BOS_ID, EOS_IDS, ModelSize, build_model, hf_config, num_params, save_pretrained
from specserve.train.tokenizer import render_chat, save_tokenizer, train_tokenizer
from specserve.train.trainer import StageConfig, train_stage

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "demo_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SAMPLE_PROMPTS = ["def fibonacci(n):\n", "ROMEO:\nO, speak again", "class Stack:\n    def __init__(self):\n"]


@dataclass(slots=True)
class DemoConfig:
    sources: list[Path] = field(default_factory=default_sources)
    out: Path = DEFAULT_OUT
    vocab_size: int = 4096
    target: ModelSize = field(default_factory=lambda: ModelSize(256, 8, 4, 2, 768))
    draft: ModelSize = field(default_factory=lambda: ModelSize(128, 2, 2, 1, 384))
    target_minutes: float = 34.0
    draft_minutes: float = 16.0
    max_steps: int | None = None          # fixed steps per stage instead of the time budget (tests)
    batch_size: int = 8
    seq_len: int = 512
    target_lr: float = 2e-3
    draft_lr: float = 3e-3
    heldout_fraction: float = 0.03
    max_corpus_mb: float = 16.0
    chat_fraction: float = 0.05           # share of training text rendered as ChatML conversations
    max_positions: int = 4096
    dtype: torch.dtype = torch.bfloat16
    eval_windows: int = 64
    seed: int = 0
    resume: bool = False


@dataclass(slots=True)
class TokenData:
    train: torch.Tensor                   # [N] int32, documents each preceded by <|endoftext|>
    heldout: dict[str, torch.Tensor]      # "code" / "text" -> [M] int32
    heldout_names: list[dict]


def run_demo(cfg: DemoConfig) -> dict:
    ckpt = cfg.out / ".ckpt"
    if not cfg.resume and ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    (cfg.out / ".gitignore").write_text(".ckpt/\n")
    timings: dict[str, float] = {}

    start = time.monotonic()
    tokenizer, data = prepare_data(cfg, ckpt)
    timings["data_s"] = time.monotonic() - start

    target_config = hf_config(cfg.target, tokenizer.get_vocab_size(), cfg.max_positions, cfg.dtype)
    target = build_model(target_config, cfg.seed)
    target_stage = StageConfig("target", cfg.target_minutes, cfg.max_steps, cfg.batch_size, cfg.seq_len, cfg.target_lr,
                               seed=cfg.seed)
    target_state = train_stage(target_stage, target, lambda batch: next_token_loss(target, batch), data.train,
                               ckpt / "target.safetensors", cfg.resume)
    timings["target_s"] = target_state.seconds
    save_pretrained(target, target_config, cfg.out, cfg.dtype)
    copy_tokenizer(ckpt, cfg.out)

    draft_config = hf_config(cfg.draft, tokenizer.get_vocab_size(), cfg.max_positions, cfg.dtype)
    draft = build_model(draft_config, cfg.seed + 1)
    target.eval().requires_grad_(False)
    draft_stage = StageConfig("draft", cfg.draft_minutes, cfg.max_steps, cfg.batch_size, cfg.seq_len, cfg.draft_lr,
                              seed=cfg.seed + 1)
    draft_state = train_stage(draft_stage, draft, lambda batch: distillation_loss(draft, target, batch), data.train,
                              ckpt / "draft.safetensors", cfg.resume)
    timings["draft_s"] = draft_state.seconds
    save_pretrained(draft, draft_config, cfg.out / "draft", cfg.dtype)
    copy_tokenizer(ckpt, cfg.out / "draft")

    start = time.monotonic()
    summary = evaluate_exported(cfg, tokenizer, data)
    timings["eval_s"] = time.monotonic() - start
    summary |= {
        "timings_s": timings,
        "target_steps": target_state.step, "draft_steps": draft_state.step,
        "target_train_loss": _tail_mean(target_state.losses), "draft_train_kl": _tail_mean(draft_state.losses),
        "target_first_loss": _head_mean(target_state.losses), "draft_first_kl": _head_mean(draft_state.losses),
        "tokens_per_step": cfg.batch_size * cfg.seq_len, "train_tokens": len(data.train),
        "target_size": asdict(cfg.target), "draft_size": asdict(cfg.draft), "seed": cfg.seed,
    }
    (cfg.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def prepare_data(cfg: DemoConfig, ckpt: Path) -> tuple[Tokenizer, TokenData]:
    """Corpus split, tokenizer and token ids, cached in the checkpoint folder."""
    cached = ckpt / "data.safetensors"
    if cfg.resume and cached.exists() and (ckpt / "tokenizer.json").exists():
        return Tokenizer.from_file(str(ckpt / "tokenizer.json")), TokenData(**load_state(cached))
    corpus = build_corpus(cfg.sources, cfg.heldout_fraction, int(cfg.max_corpus_mb * 1e6), cfg.seed)
    tokenizer = train_tokenizer([d.text for d in corpus.train], cfg.vocab_size)
    save_tokenizer(tokenizer, ckpt, model_max_length=cfg.max_positions)
    train_texts = [d.text for d in corpus.train] + chat_texts(corpus, cfg.chat_fraction, cfg.seed)
    random.Random(cfg.seed).shuffle(train_texts)
    heldout_code = [d.text for d in corpus.heldout if d.path.endswith(".py")]
    heldout_text = [d.text for d in corpus.heldout if not d.path.endswith(".py")]
    data = TokenData(
        train=encode_documents(tokenizer, train_texts),
        heldout={kind: encode_documents(tokenizer, texts) for kind, texts in (("code", heldout_code), ("text", heldout_text)) if texts},
        heldout_names=[heldout_entry(d) for d in corpus.heldout],
    )
    (cfg.out / "heldout.json").write_text(json.dumps(data.heldout_names, indent=1) + "\n")
    save_state(cached, asdict(data))
    return tokenizer, data


def chat_texts(corpus: Corpus, fraction: float, seed: int) -> list[str]:
    budget = fraction * sum(len(d.text) for d in corpus.train)
    texts, size = [], 0
    for conversation in chat_examples(corpus.train, num_examples=max(1, int(budget / 400)), seed=seed):
        texts.append(render_chat(conversation))
        size += len(texts[-1])
        if size >= budget:
            break
    return texts


def heldout_entry(doc: Document) -> dict:
    return {"name": doc.name, "path": doc.path, "chunk": doc.chunk, "num_chars": len(doc.text)}


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    ids = []
    for encoding in tokenizer.encode_batch(texts):
        ids.append(BOS_ID)
        ids.extend(encoding.ids)
    return torch.tensor(ids, dtype=torch.int32)


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, dst / name)


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    hidden, _ = model(batch[:, :-1], torch.arange(batch.shape[1] - 1))
    logits = model.compute_logits(hidden).float()                                   # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def distillation_loss(draft: nn.Module, target: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """KL(p || q) at temperature 1 against the target's logits, computed on the same batch."""
    positions = torch.arange(batch.shape[1] - 1)
    with torch.no_grad():
        hidden, _ = target(batch[:, :-1], positions)
        log_p = F.log_softmax(target.compute_logits(hidden).float(), dim=-1)           # [B, T, V]
    hidden, _ = draft(batch[:, :-1], positions)
    log_q = F.log_softmax(draft.compute_logits(hidden).float(), dim=-1)
    return F.kl_div(log_q.flatten(0, 1), log_p.flatten(0, 1), log_target=True, reduction="batchmean")


def evaluate_exported(cfg: DemoConfig, tokenizer: Tokenizer, data: TokenData) -> dict:
    """Measures the shipped files (loaded back through specserve, bf16 weights computed in float32)."""
    target = load_model(cfg.out, torch.float32)
    draft = load_model(cfg.out / "draft", torch.float32)
    summary: dict = {"target_params": num_params(target), "draft_params": num_params(draft)}
    for kind, tokens in data.heldout.items():
        batches = evaluate.windows(tokens, cfg.seq_len, cfg.eval_windows)
        summary[f"heldout_{kind}_loss"] = {"target": evaluate.heldout_loss(target, batches),
                                           "draft": evaluate.heldout_loss(draft, batches)}
        summary[f"heldout_{kind}_agreement"] = evaluate.agreement(target, draft, batches)
    summary["samples"] = {}
    for prompt in SAMPLE_PROMPTS + [render_chat([{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True)]:
        ids = [BOS_ID] + tokenizer.encode(prompt).ids
        summary["samples"][prompt] = {name: tokenizer.decode(evaluate.greedy_continue(model, ids, 48, EOS_IDS))
                                      for name, model in (("target", target), ("draft", draft))}
    return summary


def _head_mean(values: list[float], n: int = 10) -> float:
    return sum(values[:n]) / max(1, len(values[:n]))


def _tail_mean(values: list[float], n: int = 50) -> float:
    return sum(values[-n:]) / max(1, len(values[-n:]))
