"""Penalties and biases on a request's logits, row by row, with the tokens that precede each row.

OpenAI's and vLLM's semantics, in vLLM's order: logit_bias (added), min_tokens (EOS and stop_token_ids masked
while the output is shorter), repetition_penalty (over prompt and output tokens: a positive logit divided by
it, a negative one multiplied), frequency_penalty (minus penalty x count in the output) and presence_penalty
(minus penalty if in the output). Then the sampler's temperature, min_p, top-k and top-p. A verify step's row j
is processed with the committed tokens plus the draft tokens before it, so speculation sees exactly what plain
decoding sees at that position.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.sampling_params import SamplingParams


def has_processing(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.min_tokens)


def process_rows(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                 prefixes: list[list[int]], stop_ids: set[int]) -> torch.Tensor:
    """logits [n, V] of one request: row r follows its prompt, its output so far and then prefixes[r] (draft
    tokens accepted before that row) -> the processed logits (float32, a new tensor)."""
    logits = logits.float().clone()
    n, V = logits.shape
    device = logits.device
    if params.logit_bias:
        ids = torch.tensor([int(t) for t in params.logit_bias], device=device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
    if params.min_tokens and stop_ids:
        short = torch.tensor([len(output) + len(pre) < params.min_tokens for pre in prefixes], device=device)
        ids = torch.tensor(sorted(stop_ids), device=device)
        logits[:, ids] = logits[:, ids].masked_fill(short[:, None], float("-inf"))
    if not (params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty):
        return logits
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float().to(device)
    counts = counts.expand(n, V).clone()                                                    # [n, V]
    for r, pre in enumerate(prefixes):
        if pre:
            counts[r].index_add_(0, torch.tensor(pre, device=device), torch.ones(len(pre), device=device))
    if params.repetition_penalty != 1.0:
        seen = (counts > 0) | (torch.bincount(torch.tensor(prompt, dtype=torch.long), minlength=V) > 0).to(device)
        r = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).float()
    return logits


def process_batch(logits: torch.Tensor, seqs: list, prefixes: list[list[list[int]]], eos_ids: set[int]) -> torch.Tensor:
    """logits [B * R, V] (R rows per sequence) -> processed, for the sequences whose requests ask for it;
    prefixes[b][r]: the draft tokens before row r of sequence b."""
    if not any(has_processing(s.params) for s in seqs):
        return logits
    B = len(seqs)
    rows = logits.float().view(B, -1, logits.shape[-1]).clone()
    for b, seq in enumerate(seqs):
        if has_processing(seq.params):
            stop = (set() if seq.params.ignore_eos else set(eos_ids)) | set(seq.params.stop_token_ids)
            rows[b] = process_rows(rows[b], seq.params, seq.prompt_token_ids, seq.output_token_ids, prefixes[b], stop)
    return rows.view(B * rows.shape[1], -1)
