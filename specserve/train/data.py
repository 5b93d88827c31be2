"""`specserve train data`: training data by self-distillation, for the EAGLE3, draft-model and MTP trainers.

The target answers the training prompts itself (specserve's batched engine, chat template, each prompt once,
at temperature 0 or 0.7), then one cache-free forward over every conversation records what the trainers
read: token ids, the three hidden states an EAGLE3 head reads, the final hidden state (after the norm, what
MTP layers read and the logits come from), and the target's top-k next-token logits. Work is done in chunks
of prompts, each written as one shard (safetensors, see train/checkpoint.py); --resume skips finished shards.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.models.config import ModelConfig
from specserve.models.eagle3 import resolve_aux_layers
from specserve.models.registry import load_model
from specserve.train.checkpoint import load_state, save_state
from specserve.train.trainer import add_device_argument
from specserve.train.prompts import Prompt, PromptCounts, build_prompts, read_jsonl, write_jsonl

SAMPLED_TEMPERATURE = 0.7


@dataclass(slots=True)
class DataConfig:
    target: Path
    out: Path
    counts: PromptCounts = field(default_factory=PromptCounts)
    max_tokens: int = 192
    sampled_every: int = 3                # every third prompt is answered at temperature 0.7, the others greedily
    chunk_size: int = 64                  # prompts per shard (and per engine batch)
    top_k: int = 32
    minutes: float | None = None          # stop starting new shards after this much time
    max_batch_tokens: int = 2048          # tokens per forward of the recording pass
    seed: int = 0
    resume: bool = False
    answers_per_prompt: int = 1           # answers past the first are all sampled (at 0.7, each its own seed)
    device: str = "cpu"                   # where the target generates and records ("cuda" on a GPU)
    kv_cache_memory_gb: float = 2.0


@dataclass(slots=True)
class Conversations:
    """Shards concatenated: row i of every tensor is token i of some conversation."""
    input_ids: torch.Tensor               # [N] int64
    aux: torch.Tensor                     # [N, 3H] bf16: the states entering the aux layers, concatenated
    final: torch.Tensor                   # [N, H] bf16: the last layer's output after the final norm
    topk_ids: torch.Tensor                # [N, K] int64: the target's top-k next tokens after token i
    topk_logits: torch.Tensor             # [N, K] float32
    trainable: torch.Tensor               # [N] bool: token i + 1 is part of the answer
    seq_starts: torch.Tensor              # [S + 1] int64
    aux_layers: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard_{index:04d}.safetensors"


def run_data(cfg: DataConfig) -> dict:
    cfg.out.mkdir(parents=True, exist_ok=True)
    prompts_file = cfg.out / "prompts.jsonl"
    if cfg.resume and prompts_file.exists():
        train = read_jsonl(prompts_file)
    else:
        train, heldout = build_prompts(cfg.counts, cfg.seed)
        write_jsonl(prompts_file, train)
        write_jsonl(cfg.out / "heldout.jsonl", heldout)
    summary_path = cfg.out / "training_summary.json"
    summary = json.loads(summary_path.read_text()) if cfg.resume and summary_path.exists() else {
        "target": str(cfg.target), "shards": {}, "generate_seconds": 0.0, "record_seconds": 0.0}
    train = train * cfg.answers_per_prompt      # round after round, so a time-limited run covers every prompt first
    chunks = [train[i:i + cfg.chunk_size] for i in range(0, len(train), cfg.chunk_size)]
    start = time.monotonic()
    llm, target = None, None
    target_config = ModelConfig.from_pretrained(cfg.target)
    aux_layers = resolve_aux_layers(None, target_config.num_hidden_layers)
    for index in tqdm(range(len(chunks)), desc="data shards", dynamic_ncols=True, mininterval=10.0):
        if shard_path(cfg.out, index).exists() and str(index) in summary["shards"]:
            continue
        if cfg.minutes is not None and time.monotonic() - start > cfg.minutes * 60:
            print(f"time budget spent: {index} of {len(chunks)} shards written", flush=True)
            break
        if llm is None:
            from specserve.llm import LLM
            llm = LLM(str(cfg.target), speculative_method="none", max_num_seqs=cfg.chunk_size,
                      kv_cache_memory_gb=cfg.kv_cache_memory_gb, device=cfg.device)
            target = load_model(cfg.target, torch.bfloat16, cfg.device, target_config).requires_grad_(False)
        offset = index * cfg.chunk_size
        t0 = time.monotonic()
        conversations, temperatures = generate_answers(llm, chunks[index], offset, len(train) // cfg.answers_per_prompt, cfg)
        t1 = time.monotonic()
        shard = record_states(target, aux_layers, conversations, cfg)
        shard["temperature"] = torch.tensor(temperatures)
        shard["kinds"] = [p.kind for p in chunks[index]]
        save_state(shard_path(cfg.out, index), shard)
        t2 = time.monotonic()
        num_answer = int(sum(len(ids) - n for ids, n in conversations))
        summary["shards"][str(index)] = {"prompts": len(conversations), "tokens": int(shard["input_ids"].numel()),
                                         "answer_tokens": num_answer, "generate_s": t1 - t0, "record_s": t2 - t1}
        summary["generate_seconds"] += t1 - t0
        summary["record_seconds"] += t2 - t1
        write_summary(summary_path, summary, cfg)
    write_summary(summary_path, summary, cfg)
    return summary


def shard_totals(summary: dict) -> dict:
    """The totals a data summary keeps over its shards."""
    shards = summary["shards"].values()
    return {"num_prompts": sum(s["prompts"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
            "answer_tokens": sum(s["answer_tokens"] for s in shards),
            "minutes": (summary["generate_seconds"] + summary["record_seconds"]) / 60}


def write_summary(path: Path, summary: dict, cfg: DataConfig) -> None:
    summary |= shard_totals(summary) | {"max_tokens": cfg.max_tokens, "sampled_temperature": SAMPLED_TEMPERATURE,
                "sampled_every": cfg.sampled_every, "answers_per_prompt": cfg.answers_per_prompt, "top_k": cfg.top_k,
                "seed": cfg.seed}
    path.write_text(json.dumps(summary, indent=2) + "\n")


def answer_temperature(index: int, num_prompts: int, cfg: DataConfig) -> float:
    """Answer `index` of the expanded list (round index // num_prompts): in the first round every
    sampled_every-th prompt is sampled and the others are greedy; later rounds are all sampled."""
    first_round = index < num_prompts
    greedy = first_round and index % cfg.sampled_every != cfg.sampled_every - 1
    return 0.0 if greedy else SAMPLED_TEMPERATURE


def generate_answers(llm, prompts: list[Prompt], offset: int, num_prompts: int,
                     cfg: DataConfig) -> tuple[list[tuple[list[int], int]], list[float]]:
    """(conversation ids, number of prompt tokens) per prompt, answered in one engine batch; the answer keeps
    its end-of-turn token, so drafters learn where a turn ends."""
    from specserve.sampling_params import SamplingParams
    from specserve.tokenizer import normalize_messages
    tok = llm.tokenizer
    ids, params, temperatures = [], [], []
    for i, p in enumerate(prompts):
        text = tok.apply_chat_template(normalize_messages([{"role": "user", "content": p.text}]), add_generation_prompt=True)
        ids.append(tok.encode(text, add_special_tokens=False))
        temperature = answer_temperature(offset + i, num_prompts, cfg)
        temperatures.append(temperature)
        params.append(SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens, seed=cfg.seed + offset + i))
    outputs = llm.generate(ids, params)
    return [(prompt + list(out.outputs[0].token_ids), len(prompt)) for prompt, out in zip(ids, outputs)], temperatures


@torch.no_grad()
def record_states(target: torch.nn.Module, aux_layers: tuple[int, ...], conversations: list[tuple[list[int], int]],
                  cfg: DataConfig) -> dict:
    """One cache-free forward per group of similar-length conversations (right-padded: causal attention keeps
    padding out of the real tokens' states)."""
    order = sorted(range(len(conversations)), key=lambda i: len(conversations[i][0]))
    rows: dict[int, dict[str, torch.Tensor]] = {}
    group: list[int] = []

    def flush() -> None:
        length = max(len(conversations[i][0]) for i in group)
        batch = torch.zeros(len(group), length, dtype=torch.long)
        for row, i in enumerate(group):
            batch[row, :len(conversations[i][0])] = torch.tensor(conversations[i][0])
        batch = batch.to(cfg.device)
        final, aux = target(batch, torch.arange(length, device=batch.device), None, aux_layers)
        top = target.compute_logits(final).topk(cfg.top_k, dim=-1)
        final, aux, top = final.cpu(), [a.cpu() for a in aux], (top.values.cpu(), top.indices.cpu())
        for row, i in enumerate(group):
            n = len(conversations[i][0])
            rows[i] = {"aux": torch.cat([a[row, :n] for a in aux], dim=-1).to(torch.bfloat16),
                       "final": final[row, :n].to(torch.bfloat16), "topk_ids": top[1][row, :n].to(torch.int32),
                       "topk_logits": top[0][row, :n].to(torch.bfloat16)}
        group.clear()

    for i in order:
        if group and (len(group) + 1) * len(conversations[i][0]) > cfg.max_batch_tokens:
            flush()
        group.append(i)
    if group:
        flush()
    lengths = [len(c[0]) for c in conversations]
    shard = {name: torch.cat([rows[i][name] for i in range(len(conversations))]) for name in rows[0]}
    shard["input_ids"] = torch.tensor([t for c in conversations for t in c[0]], dtype=torch.int32)
    shard["num_prompt_tokens"] = torch.tensor([c[1] for c in conversations], dtype=torch.int64)
    shard["lengths"] = torch.tensor(lengths, dtype=torch.int64)
    shard["aux_layers"] = list(aux_layers)
    return shard


def load_conversations(data_dir: Path, max_shards: int | None = None, device: str = "cpu",
                       skip: tuple[str, ...] = ()) -> Conversations:
    """Every finished shard of a data folder, concatenated on `device` (each shard moved there as it is read);
    the states named in `skip` ("aux", "final") are left out (empty), for trainers that do not read them."""
    summary = json.loads((data_dir / "training_summary.json").read_text())
    indices = sorted(int(i) for i in summary["shards"])[:max_shards]
    if not indices:
        raise ValueError(f"{data_dir} holds no finished data shard: run `specserve train data` first")
    on_device = lambda s: {k: (v[:0] if k in skip else v).to(device) if isinstance(v, torch.Tensor) else v
                           for k, v in s.items()}
    shards = [on_device(load_state(shard_path(data_dir, i))) for i in indices]
    lengths = torch.cat([s["lengths"] for s in shards])
    num_prompt = torch.cat([s["num_prompt_tokens"] for s in shards])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), lengths.cumsum(0)])
    trainable = torch.zeros(int(starts[-1]), dtype=torch.bool, device=device)
    for s, n, length in zip(starts[:-1].tolist(), num_prompt.tolist(), lengths.tolist()):
        trainable[s + n - 1:s + length - 1] = True     # positions whose next token is an answer token
    cat = lambda name: torch.cat([s[name] for s in shards])
    return Conversations(input_ids=cat("input_ids").long(), aux=cat("aux"), final=cat("final"),
                         topk_ids=cat("topk_ids").long(), topk_logits=cat("topk_logits").float(), trainable=trainable,
                         seq_starts=starts, aux_layers=tuple(shards[0]["aux_layers"]))


def add_data_parser(subparsers: argparse._SubParsersAction) -> None:
    d = DataConfig(Path("."), Path("."))
    c = d.counts
    p = subparsers.add_parser("data", help="self-distillation data: the target's own answers and hidden states",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, default=None, help="the target model folder (default: the default model)")
    p.add_argument("--out", type=Path, required=True, help="data folder (shards, prompts, held-out prompts)")
    for kind in ("math", "code", "explain", "question", "prose"):
        p.add_argument(f"--num-{kind}", type=int, default=getattr(c, kind), help=f"{kind} prompts")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--chunk-size", type=int, default=d.chunk_size)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--minutes", type=float, default=None, help="start no new shard after this many minutes")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="keep finished shards")
    p.add_argument("--answers-per-prompt", type=int, default=d.answers_per_prompt,
                   help="answers recorded per prompt; those past the first are sampled at 0.7, each with its own seed")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="tokens per forward of the pass that records the target's states")
    p.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb)
    add_device_argument(p)
    p.set_defaults(func=run_data_command)


def default_target() -> Path:
    from specserve.config import default_model_dir
    return Path(default_model_dir())


def run_data_command(args: argparse.Namespace) -> None:
    counts = PromptCounts(args.num_math, args.num_code, args.num_explain, args.num_question, args.num_prose)
    cfg = DataConfig(target=args.target or default_target(), out=args.out, counts=counts, max_tokens=args.max_tokens,
                     chunk_size=args.chunk_size, top_k=args.top_k, minutes=args.minutes, seed=args.seed,
                     resume=args.resume, answers_per_prompt=args.answers_per_prompt,
                     max_batch_tokens=args.max_batch_tokens, kv_cache_memory_gb=args.kv_cache_memory_gb,
                     device=args.device)
    print(json.dumps(run_data(cfg), indent=2))


def segment_ids(data: Conversations) -> torch.Tensor:
    """[N] int64: the conversation each token belongs to."""
    lengths = data.seq_starts[1:] - data.seq_starts[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
