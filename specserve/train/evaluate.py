"""Held-out measurements of the demo models: loss per token, draft/target agreement, greedy samples."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def windows(tokens: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens (the last token of one is the first of the next)."""
    seq_len = min(seq_len, len(tokens) - 1)
    count = min(max_windows, (len(tokens) - 1) // seq_len)
    return torch.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)]).long()   # [N, T + 1]


@torch.no_grad()
def logits_of(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    hidden, _ = model(input_ids, torch.arange(input_ids.shape[1]))
    return model.compute_logits(hidden).float()                                  # [B, T, V]


@torch.no_grad()
def heldout_loss(model: nn.Module, batches: torch.Tensor, batch_size: int = 8) -> float:
    """Mean cross-entropy per token (nats) on the windows."""
    total, count = 0.0, 0
    for chunk in batches.split(batch_size):
        logits = logits_of(model, chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count


@torch.no_grad()
def agreement(target: nn.Module, draft: nn.Module, batches: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    """On held-out text: how often the draft's greedy token equals the target's (greedy acceptance per
    token), and the mean of sum_x min(p, q) (acceptance per token when both sample at temperature 1)."""
    same, overlap, count = 0.0, 0.0, 0
    for chunk in batches.split(batch_size):
        p = logits_of(target, chunk[:, :-1])
        q = logits_of(draft, chunk[:, :-1])
        same += (p.argmax(-1) == q.argmax(-1)).sum().item()
        overlap += torch.minimum(p.softmax(-1), q.softmax(-1)).sum(-1).sum().item()
        count += p.shape[0] * p.shape[1]
    return {"greedy_agreement": same / count, "sampled_acceptance": overlap / count}


@torch.no_grad()
def greedy_continue(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each step (cache-free, for short samples only)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        next_id = int(logits_of(model, torch.tensor([ids]))[0, -1].argmax())
        if next_id in stop_ids:
            break
        ids.append(next_id)
    return ids[len(prompt_ids):]
