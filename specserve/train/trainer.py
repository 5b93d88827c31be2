"""One training stage: AdamW, warmup + cosine over the planned steps, a wall-clock budget, checkpoints.

With a time budget the schedule runs on progress = training time spent / budget, and the stage ends when
the budget is spent; the number of steps is estimated from the measured step time (the last RECENT_STEPS
steps, re-estimated every REPLAN_SECONDS) for the warmup and the progress bar only. (Progress once ran on
step / planned steps: on a GPU the plan made at step 10, during warm-up, ended runs after a fifth of their
budget.) With max_steps the plan is fixed and the run is reproducible step for step.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from specserve.train.checkpoint import load_state, save_state

RECENT_STEPS = 50
REPLAN_SECONDS = 60.0
STALL_FACTOR = 20.0

# autocast feeds bf16 activations to fp32 norm weights; the unfused rms_norm it falls back to is correct
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")


@dataclass(slots=True)
class StageConfig:
    name: str
    minutes: float
    max_steps: int | None = None
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: bool = True                  # bf16 autocast: about 2x the tokens/s of fp32 on these CPUs
    seed: int = 0
    checkpoint_minutes: float = 3.0
    device: str = "cpu"                # where the model and its batches live ("cuda" on a GPU)


@dataclass(slots=True)
class StageState:
    step: int = 0
    planned_steps: int = 0
    progress: float = 0.0
    seconds: float = 0.0               # training time spent, summed over resumed runs
    losses: list[float] = field(default_factory=list)
    done: bool = False


@dataclass(slots=True)
class ThreadChooser:
    """On contended cores a 2-thread step can be 10x slower than a 1-thread one (OpenMP waits for a
    descheduled thread), so every `period` steps it times `probe` steps per option and keeps the fastest."""
    options: tuple[int, ...]
    period: int = 100
    probe: int = 3
    timings: dict[int, list[float]] = field(default_factory=dict)
    chosen: int = 0

    def threads_for(self, step: int) -> int:
        phase = step % self.period
        if phase < self.probe * len(self.options):
            return self.options[phase // self.probe]
        if phase == self.probe * len(self.options) and self.timings:
            self.chosen = min(self.timings, key=lambda n: statistics.median(self.timings[n]))
            self.timings.clear()
        return self.chosen or self.options[-1]

    def record(self, threads: int, seconds: float) -> None:
        self.timings.setdefault(threads, []).append(seconds)


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """Random contiguous windows of seq_len + 1 tokens; step-seeded, so a resumed run sees the same batches."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).long()     # [B, T + 1]


def learning_rate(cfg: StageConfig, step: int, progress: float, planned_steps: int) -> float:
    warmup_steps = min(cfg.warmup_steps, max(1, planned_steps // 10)) if planned_steps else cfg.warmup_steps
    warmup = min(1.0, (step + 1) / warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * warmup * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: nn.Module, cfg: StageConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95))


def autocast(cfg: StageConfig):
    return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16) if cfg.bf16 else nullcontext()


def optimizer_step(cfg: StageConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                   loss_fn: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    with autocast(cfg):
        loss = loss_fn(batch)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def train_stage(cfg: StageConfig, model: nn.Module, loss_fn: Callable[[torch.Tensor], torch.Tensor],
                tokens: torch.Tensor, checkpoint: Path, resume: bool) -> StageState:
    """Trains model on batches of `tokens` with loss_fn(batch [B, T + 1]) -> scalar. Returns the stage's state;
    a finished stage found in the checkpoint (with resume) is loaded and returned without training."""
    optimizer = make_optimizer(model, cfg)
    state = StageState(planned_steps=cfg.max_steps or 0)
    if resume and checkpoint.exists():
        saved = load_state(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = StageState(**saved["state"])
        if state.done:
            return state
        print(f"[{cfg.name}] resuming at step {state.step} ({state.seconds / 60:.1f} min done)", file=sys.stderr)
    budget = cfg.minutes * 60
    on_cpu = torch.device(cfg.device).type == "cpu"
    threads = ThreadChooser(options=tuple(sorted({1, os.cpu_count() or 1})) if on_cpu else (torch.get_num_threads(),))
    recent: deque[float] = deque(maxlen=RECENT_STEPS)
    last_replan = last_checkpoint = time.monotonic()
    bar = tqdm(desc=cfg.name, total=state.planned_steps or None, initial=state.step, dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    smoothed = None
    model.train()
    while not _finished(cfg, state, budget):
        num_threads = threads.threads_for(state.step)
        torch.set_num_threads(num_threads)
        start = time.monotonic()
        lr = learning_rate(cfg, state.step, state.progress, state.planned_steps)
        batch = sample_batch(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, state.step).to(cfg.device)
        state.losses.append(optimizer_step(cfg, model, optimizer, loss_fn, batch, lr))
        seconds = stall_free(time.monotonic() - start, recent)
        threads.record(num_threads, seconds)
        recent.append(seconds)
        state.step += 1
        state.seconds += seconds
        smoothed = state.losses[-1] if smoothed is None else 0.95 * smoothed + 0.05 * state.losses[-1]
        now = time.monotonic()
        if cfg.max_steps is None and (state.step == 10 or now - last_replan > REPLAN_SECONDS):
            state.planned_steps = state.step + int(max(0.0, budget - state.seconds) / (sum(recent) / len(recent)))
            bar.total = state.planned_steps
            last_replan = now
        if cfg.max_steps is None:      # a time budget: the schedule runs on the time spent, which a bad plan can't cut short
            state.progress = max(state.progress, min(1.0, state.seconds / budget))
        elif state.planned_steps:
            state.progress = max(state.progress, state.step / state.planned_steps)
        bar.update(1)
        tokens_per_second = cfg.batch_size * cfg.seq_len * len(recent) / sum(recent)
        bar.set_postfix(loss=f"{smoothed:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:.0f}", threads=num_threads,
                        left=f"{_seconds_left(cfg, state, recent, budget) / 60:.1f}m", refresh=False)
        if now - last_checkpoint > cfg.checkpoint_minutes * 60:
            save_checkpoint(checkpoint, model, optimizer, state)
            last_checkpoint = now
    bar.close()
    state.done = True
    save_checkpoint(checkpoint, model, optimizer, state)
    return state


def stall_free(seconds: float, recent: deque[float]) -> float:
    """A step's time, or the recent median where it took over STALL_FACTOR times that: the process was suspended
    or the machine stalled, and neither the budget nor the plan (whose progress never goes back) should pay."""
    if len(recent) < 10:
        return seconds
    median = statistics.median(recent)
    return median if seconds > STALL_FACTOR * median else seconds


def _finished(cfg: StageConfig, state: StageState, budget: float) -> bool:
    if cfg.max_steps is not None:
        return state.step >= cfg.max_steps
    return state.seconds >= budget


def _seconds_left(cfg: StageConfig, state: StageState, recent: deque[float], budget: float) -> float:
    if cfg.max_steps is not None:
        return (cfg.max_steps - state.step) * sum(recent) / len(recent)
    return max(0.0, budget - state.seconds)


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: StageState) -> None:
    """A safetensors file (see train/checkpoint.py): resuming loads tensors and JSON, nothing unpickled."""
    save_state(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "state": {f: getattr(state, f) for f in StageState.__dataclass_fields__}})


def add_device_argument(parser) -> None:
    parser.add_argument("--device", default="cpu", help="where to train: cpu, cuda or cuda:N")


def continued_from(init: Path | None) -> dict:
    """The summary entry of a run that continued training a saved drafter: that drafter's own summary, so the
    training spent on shipped weights adds up across runs."""
    if init is None or not (init / "training_summary.json").exists():
        return {}
    return {"continued_from": json.loads((init / "training_summary.json").read_text())}
