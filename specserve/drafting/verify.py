"""Verification of chain drafts: pure functions from the target's outputs to the accepted tokens.

Notation as in the papers: p = target distribution, q = draft distribution. Rows of a batch may
draft different numbers of tokens: num_draft[b] <= K, and draft positions j >= num_draft[b] are
ignored. p[:, j] is the target's distribution for the token at draft position j (p[:, 0] follows
the last committed token; p[:, num_draft] is the bonus distribution after a fully accepted draft).

Both functions return (tokens [B, K+1], num_tokens [B]): num_tokens = accepted + 1, and
tokens[b, :num_tokens[b]] are the tokens to commit; entries past num_tokens are -1.
"""
import torch

from specserve.layers.sampler import sample_from_probs


def verify_greedy(
    target_argmax: torch.Tensor,  # [B, K+1] int64
    draft_tokens: torch.Tensor,   # [B, K] int64
    num_draft: torch.Tensor,      # [B] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest draft prefix equal to the target's argmax, then the target's own token."""
    K = draft_tokens.shape[1]
    valid = torch.arange(K, device=draft_tokens.device)[None, :] < num_draft[:, None]  # [B, K]
    match = (draft_tokens == target_argmax[:, :K]) & valid                          # [B, K]
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)                           # [B]
    final = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)               # [B]
    return _assemble(draft_tokens, num_accepted, final)


def verify_rejection(
    p: torch.Tensor,             # [B, K+1, V] target probs
    draft_tokens: torch.Tensor,  # [B, K] int64
    num_draft: torch.Tensor,     # [B] int64
    q: torch.Tensor | None,      # [B, K, V] draft probs; None = deterministic drafts (one-hot q)
    u_accept: torch.Tensor,      # [B, K] uniforms in [0, 1)
    u_sample: torch.Tensor,      # [B] uniforms in [0, 1), or [B, K+1]: one per position, picked at the final one
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): every committed token is
    distributed exactly as a sample from p given its prefix, whatever q is."""
    B, K = draft_tokens.shape
    rows = torch.arange(B, device=p.device)
    valid = torch.arange(K, device=p.device)[None, :] < num_draft[:, None]          # [B, K]
    x = draft_tokens.clamp(min=0)                                                   # [B, K]
    p_x = p[:, :K].gather(2, x[..., None]).squeeze(2)                               # [B, K]
    # accept x_j with probability min(1, p_j(x_j) / q_j(x_j)):  u < p/q  <=>  u * q < p
    q_x = torch.ones_like(p_x) if q is None else q.gather(2, x[..., None]).squeeze(2)
    accept = (u_accept * q_x < p_x) & valid                                         # [B, K]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)                          # [B]

    # The next token comes from p at the first rejected position, or p_{num_draft} (the bonus).
    p_n = p[rows, num_accepted]                                                     # [B, V]
    if K > 0:
        # at the first rejection sample from normalize(max(p_j - q_j, 0)); for one-hot q that is p_j
        # with x_j removed; if the residual has no mass (p_j == q_j), from p_j itself
        j = num_accepted.clamp(max=K - 1)
        if q is None:
            residual = p_n.scatter(1, x[rows, j][:, None], 0.0)
        else:
            residual = (p_n - q[rows, j]).clamp(min=0)
        use_residual = (num_accepted < num_draft) & (residual.sum(dim=1) > 0)       # [B]
        p_n = torch.where(use_residual[:, None], residual, p_n)
    if u_sample.dim() == 2:
        u_sample = u_sample.gather(1, num_accepted[:, None]).squeeze(1)
    final = sample_from_probs(p_n, u_sample)                                        # [B]
    return _assemble(draft_tokens, num_accepted, final)


def _assemble(
    draft_tokens: torch.Tensor,  # [B, K]
    num_accepted: torch.Tensor,  # [B]
    final: torch.Tensor,         # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    B, K = draft_tokens.shape
    accepted = torch.arange(K, device=draft_tokens.device)[None, :] < num_accepted[:, None]  # [B, K]
    tokens = torch.full((B, K + 1), -1, dtype=torch.long, device=draft_tokens.device)
    tokens[:, :K] = torch.where(accepted, draft_tokens, -1)
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return tokens, num_accepted + 1
