"""The target's log-probabilities of the tokens a request emits (OpenAI's `logprobs` / `top_logprobs`).

They are the raw model distribution (log_softmax of the target's logits, before temperature, top-k and top-p:
vLLM's default `logprobs-mode`, raw_logprobs), taken from the verify forward that committed each token. A
token's row is the one plain decoding computes for it (row invariance, docs/ARCHITECTURE.md), so speculative
and plain decoding report the same values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()     # the most likely tokens at its position, most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """logits [n, V] at the rows that produced `tokens` (row j: tokens[j]) -> each token's logprob and the
    num_top most likely at its row."""
    logp = torch.log_softmax(logits.float(), dim=-1)                                       # [n, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None]).view(-1).tolist()
    if num_top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    top = logp.topk(num_top, dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(ids, values)))
            for t, lp, ids, values in zip(tokens, chosen, top.indices.tolist(), top.values.tolist())]
