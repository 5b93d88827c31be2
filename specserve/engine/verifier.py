"""One step's verification: from the target's hidden states to the tokens each sequence commits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.scheduler import ScheduledSeq
from specserve.engine.sequence import Sequence
from specserve.layers.sampler import compute_probs, position_uniforms, sample_from_probs
from specserve.spec.tree import Tree, accept_tree
from specserve.spec.verify import verify_greedy, verify_rejection


@dataclass(slots=True)
class DraftOf:
    """One sequence's draft in one step: its tokens, q rows when sampled, its tree when not a chain."""
    token_ids: list[int]
    probs: torch.Tensor | None = None      # [k, V]
    tree: Tree | None = None


def verify_step(scheduled: list[ScheduledSeq], draft: dict[int, DraftOf], hidden: torch.Tensor, compute_logits
                ) -> tuple[list[list[int] | None], list[list[int]], dict[int, list[int]]]:
    """The target's hidden states -> (committed tokens per scheduled sequence, None mid-prompt; the rows of
    hidden whose tokens were committed; the accepted node path of each tree draft, by scheduled index).

    Logits are computed only at sampling rows. Greedy rows take the argmax; sampled rows draw from
    compute_probs with the uniform of the sequence position each row's token would take. Chains are
    accepted while the draft equals the target's draw (exact for deterministic drafts); chains sampled
    from q use the rejection rule instead; trees follow the child that matches the target's draw.
    """
    sample_idx, rows, offset, row_offsets = [], [], 0, []
    for i, s in enumerate(scheduled):
        n = s.num_new + (len(draft[i].token_ids) if i in draft else 0)
        row_offsets.append(offset)
        if s.completes_prompt:
            sample_idx.append(i)
            rows.append(list(range(offset + s.num_new - 1, offset + n)))
        offset += n
    tokens: list[list[int] | None] = [None] * len(scheduled)
    paths: dict[int, list[int]] = {}
    if sample_idx:
        B, K = len(sample_idx), max(len(r) for r in rows) - 1
        pad = torch.tensor([r + [r[-1]] * (K + 1 - len(r)) for r in rows], device=hidden.device)  # [B, K+1]
        logits = compute_logits(hidden[pad.view(-1)])                                  # [B*(K+1), V]
        seqs = [scheduled[i].seq for i in sample_idx]
        drafts = [draft.get(i) for i in sample_idx]
        if all(seq.params.greedy for seq in seqs):
            y = logits.float().view(B, K + 1, -1).argmax(dim=-1).cpu()   # [B, K+1]; fp32: bf16 argmax is slow
            p = None
        else:
            p = compute_probs(logits, *sampling_tensors(seqs, K + 1, logits.device)).view(B, K + 1, -1).cpu()
            # the uniform of a row is the one of the sequence position its token would take
            depth = [d.tree.depth.tolist() if d is not None and d.tree is not None else list(range(1, K + 1))
                     for d in drafts]
            positions = [[len(seq)] + [len(seq) + x for x in dep] + [len(seq)] * (K - len(dep))
                         for seq, dep in zip(seqs, depth)]
            u = position_uniforms([seq.seed for seq in seqs], positions)                          # [B, K+1]
            y = sample_from_probs(p.view(B * (K + 1), -1), u.view(-1)).view(B, K + 1)
        chain = [b for b, d in enumerate(drafts) if d is None or d.tree is None]
        sampled_q = [b for b in chain if drafts[b] is not None and drafts[b].probs is not None and p is not None]
        if K == 0:      # no drafts this step: each row's draw is its token
            for b, token in enumerate(y[:, 0].tolist()):
                tokens[sample_idx[b]] = [token]
        elif chain:
            draft_tokens = torch.tensor([(drafts[b].token_ids if drafts[b] else []) + [0] * (K - len(rows[b]) + 1)
                                         for b in chain], dtype=torch.int64).view(len(chain), K)
            num_draft = torch.tensor([len(rows[b]) - 1 for b in chain])
            out, num = verify_greedy(y[chain], draft_tokens, num_draft)
            if sampled_q:   # drafts sampled from q: the rejection rule (Leviathan et al.) on those rows
                sub = [chain.index(b) for b in sampled_q]
                q = torch.zeros(len(sampled_q), K, p.shape[-1])
                for r, b in enumerate(sampled_q):
                    q[r, :len(drafts[b].token_ids)] = drafts[b].probs[:, :p.shape[-1]].cpu()
                seeds = [seqs[b].seed for b in sampled_q]
                starts = [[len(seqs[b]) + j for j in range(K + 1)] for b in sampled_q]
                u_accept = position_uniforms(seeds, [s[:K] for s in starts], stream=1)
                u_sample = position_uniforms(seeds, starts)
                out_q, num_q = verify_rejection(p[sampled_q], draft_tokens[sub], num_draft[sub], q, u_accept, u_sample)
                out[sub], num[sub] = out_q, num_q
            out, num = out.tolist(), num.tolist()
            for r, b in enumerate(chain):
                tokens[sample_idx[b]] = out[r][:num[r]]
        for b, d in enumerate(drafts):
            if d is not None and d.tree is not None:
                n = len(d.token_ids)
                accepted, final = accept_tree(y[b:b + 1, :n + 1], d.tree, torch.tensor([d.token_ids]))
                path = accepted[0].nonzero().squeeze(1).tolist()
                tokens[sample_idx[b]] = [d.token_ids[j] for j in path] + [int(final[0])]
                paths[sample_idx[b]] = path
    committed = []
    for i, s in enumerate(scheduled):
        base = row_offsets[i]
        if i in paths:   # tree: the last token, then the accepted path's nodes
            committed.append(list(range(base, base + s.num_new)) + [base + s.num_new + j for j in paths[i]])
        else:
            num_valid = s.num_new + (len(tokens[i]) - 1 if tokens[i] else 0)
            committed.append(list(range(base, base + num_valid)))
    return tokens, committed, paths


def sampling_tensors(seqs: list[Sequence], rows_each: int, device) -> tuple[torch.Tensor, ...]:
    temperature = torch.tensor([seq.params.temperature for seq in seqs]).repeat_interleave(rows_each)
    top_k = torch.tensor([seq.params.top_k for seq in seqs]).repeat_interleave(rows_each)
    top_p = torch.tensor([seq.params.top_p for seq in seqs]).repeat_interleave(rows_each)
    return temperature.to(device), top_k.to(device), top_p.to(device)
