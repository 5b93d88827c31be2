"""One step's verification: from the target's hidden states to the tokens each sequence commits.

Four small steps, each a function of tensors and lists: gather the rows to sample (`gather_rows`),
draw the target at them (`draw_target`), accept each draft by its kind (`accept_chains`,
`accept_tree_draft`), and name the rows whose tokens were committed (`committed_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.engine.logprobs import TokenLogprob, token_logprobs
from specserve.engine.scheduler import ScheduledSeq
from specserve.layers.logits_processors import has_processing, process_batch
from specserve.runtime.sequence import Sequence
from specserve.layers.sampler import compute_probs, position_uniforms, sample_from_probs
from specserve.sampling_params import sampling_tensors
from specserve.drafting.proposer import Draft
from specserve.drafting.tree import Tree, accept_tree
from specserve.drafting.verify import verify_greedy, verify_rejection


@dataclass(slots=True)
class Verified:
    """One step's verification, by scheduled index."""
    tokens: list[list[int] | None]     # the tokens each sequence commits; None mid-prompt
    rows: list[list[int]]              # the rows of hidden whose tokens were committed, in token order
    paths: dict[int, list[int]]        # the accepted node path of each tree draft
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)   # requests that ask: per token
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)   # of this step's prompt tokens


@dataclass(slots=True)
class SampleRows:
    """Where the flat hidden states of one step are sampled."""
    seqs: list[int]                    # scheduled indices of the sequences that sample (prompt complete)
    rows: list[list[int]]              # for each of them: its last token's row, then one per draft token
    offsets: list[int]                 # for every scheduled sequence: its first row


def verify_step(scheduled: list[ScheduledSeq], draft: Draft, hidden: torch.Tensor, compute_logits,
                eos_ids: set[int] = frozenset()) -> Verified:
    """The target's hidden states [N, H] -> the tokens each scheduled sequence commits (draft: one row per
    scheduled sequence). Logits are computed only at sampling rows; penalties and biases are applied to each
    row with the tokens before it (layers/logits_processors.py); logprobs are of the raw logits."""
    where = gather_rows(scheduled, draft)
    tokens: list[list[int] | None] = [None] * len(scheduled)
    paths: dict[int, list[int]] = {}
    prompt = prompt_logprobs(scheduled, hidden, compute_logits, where.offsets)
    if where.seqs:
        K = max(len(r) for r in where.rows) - 1
        flat = [r for rows in where.rows for r in rows]
        logits = compute_logits(hidden[torch.tensor(flat, device=hidden.device)])     # [N, V]: sampling rows only
        pad = padded_rows([len(r) for r in where.rows], K, logits.device)             # [B, K+1] rows of logits
        seqs = [scheduled[i].seq for i in where.seqs]
        trees = [draft.trees[i] for i in where.seqs]
        if any(has_processing(seq.params) or seq.grammar is not None for seq in seqs):
            prefixes = [row_prefixes(draft.token_ids[i], tree, K) for i, tree in zip(where.seqs, trees)]
            logits_p = process_batch(grammar_masked(logits[pad.view(-1)], seqs, prefixes), seqs, prefixes, eos_ids)
            y, p = draw_target(logits_p, seqs, trees, K)
        else:                                   # the common case: raw logits, no per-row token lists built
            y, p = draw_target(logits, seqs, trees, K, pad)
        chain = [b for b, tree in enumerate(trees) if tree is None]
        if chain:
            ids = [draft.token_ids[where.seqs[b]] for b in chain]
            qs = [draft.probs[where.seqs[b], :len(d)] if draft.probs is not None and d else None
                  for b, d in zip(chain, ids)]
            every = len(chain) == len(seqs)            # the common case: no copy of y and p
            y_c = y if every else y[chain]
            p_c = p if every or p is None else p[chain]
            for b, accepted in zip(chain, accept_chains(y_c, p_c, ids, qs, [seqs[b] for b in chain])):
                tokens[where.seqs[b]] = accepted
        for b, tree in enumerate(trees):
            if tree is not None:
                i = where.seqs[b]
                tokens[i], paths[i] = accept_tree_draft(y[b], tree, draft.token_ids[i])
        logprobs = committed_logprobs(logits, pad, where.seqs, seqs, tokens, paths)
        return Verified(tokens, committed_rows(scheduled, where.offsets, tokens, paths), paths, logprobs, prompt)
    return Verified(tokens, committed_rows(scheduled, where.offsets, tokens, paths), paths, prompt_logprobs=prompt)


def prompt_logprobs(scheduled: list[ScheduledSeq], hidden: torch.Tensor, compute_logits, offsets: list[int]
                    ) -> dict[int, list[TokenLogprob]]:
    """For requests that ask: the logprobs of the prompt tokens this step's prompt chunks predict (the row of
    position t gives token t + 1's; the prompt's last row predicts the first output token, reported there)."""
    out = {}
    for i, s in enumerate(scheduled):
        seq = s.seq
        if seq.params.prompt_logprobs is None or s.num_new <= 0:
            continue
        start, num_prompt = seq.num_computed_tokens, seq.num_prompt_tokens
        positions = [p for p in range(start, start + s.num_new) if p + 1 < num_prompt]
        if not positions:
            continue
        rows = torch.tensor([offsets[i] + p - start for p in positions], device=hidden.device)
        out[i] = token_logprobs(compute_logits(hidden[rows]), [seq.token_ids[p + 1] for p in positions],
                                seq.params.prompt_logprobs)
    return out


def committed_logprobs(logits: torch.Tensor, pad: torch.Tensor, indices: list[int], seqs: list[Sequence],
                       tokens: list[list[int] | None], paths: dict[int, list[int]]) -> dict[int, list[TokenLogprob]]:
    """logits [N, V] of the sampling rows (pad [B, K+1]: sequence b's row j) -> the logprobs of each committed token,
    for the requests that ask. Token j of a chain came from row j; of a tree, from the row of the path node before
    it (row 0: the root)."""
    out = {}
    for b, (i, seq) in enumerate(zip(indices, seqs)):
        if seq.params.logprobs is None:
            continue
        path = paths.get(i)
        rows = list(range(len(tokens[i]))) if path is None else [0] + [node + 1 for node in path[:len(tokens[i]) - 1]]
        out[i] = token_logprobs(logits[pad[b, rows]], tokens[i], seq.params.logprobs)
    return out


def grammar_masked(logits: torch.Tensor, seqs: list[Sequence], prefixes: list[list[list[int]]]) -> torch.Tensor:
    """logits [B * (K+1), V], with every token a request's grammar forbids after each row's tokens at -inf (a
    copy; the raw logits still give the logprobs)."""
    if all(seq.grammar is None for seq in seqs):
        return logits
    rows = logits.view(len(seqs), -1, logits.shape[-1]).clone()
    for b, seq in enumerate(seqs):
        if seq.grammar is not None:
            allowed = seq.grammar.allowed(prefixes[b]).to(rows.device)                  # [K+1, V]
            rows[b] = rows[b].masked_fill(~allowed, float("-inf"))
    return rows.view(logits.shape)


def row_prefixes(tokens: list[int], tree: Tree | None, K: int) -> list[list[int]]:
    """The draft tokens before each of a sequence's K + 1 sampling rows: a chain's row j follows tokens[:j]; a
    tree's row n + 1 follows node n's path from the root (rows past the draft repeat the last)."""
    if tree is None:
        rows = [tokens[:j] for j in range(len(tokens) + 1)]
    else:
        paths = [[tokens[m] for m in torch.nonzero(tree.attn_mask[n]).view(-1).tolist()] for n in range(len(tokens))]
        rows = [[]] + paths
    return rows + [rows[-1]] * (K + 1 - len(rows))


def gather_rows(scheduled: list[ScheduledSeq], draft: Draft) -> SampleRows:
    """A sequence's rows are its new tokens, then its draft tokens; one whose prompt completes samples
    at its last new token and at every draft token."""
    seqs, rows, offsets, offset = [], [], [], 0
    for i, s in enumerate(scheduled):
        n = s.num_new + len(draft.token_ids[i])
        offsets.append(offset)
        if s.completes_prompt:
            seqs.append(i)
            rows.append(list(range(offset + s.num_new - 1, offset + n)))
        offset += n
    return SampleRows(seqs, rows, offsets)


def padded_rows(lengths: list[int], K: int, device) -> torch.Tensor:
    """[B, K+1]: where sequence b's sampling row j lies among all sequences' rows laid end to end (rows past its
    last repeat its last). Logits are computed at the rows themselves: padded, a sequence drafting 8 tokens beside
    15 drafting none made 144 rows of the vocabulary's matmul out of 24."""
    firsts, last = torch.tensor([0] + lengths[:-1]).cumsum(0), torch.tensor(lengths) - 1
    return (firsts[:, None] + torch.minimum(torch.arange(K + 1)[None, :], last[:, None])).to(device)


def draw_target(logits: torch.Tensor, seqs: list[Sequence], trees: list[Tree | None], K: int,
                pad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B*(K+1), V], or [N, V] with pad [B, K+1] naming each sequence's row j -> (y [B, K+1], the target's
    draw at every row; p [B, K+1, V], or None when every sequence is greedy). Greedy takes the argmax; sampling draws
    from compute_probs with the uniform of the sequence position the row's token would take (a tree node's: by its
    depth)."""
    B = len(seqs)
    if all(seq.params.greedy for seq in seqs):
        y = logits.float().argmax(dim=-1)                                       # fp32: bf16 argmax is slow
        return (y.view(B, K + 1) if pad is None else y[pad]).cpu(), None
    if pad is not None:
        logits = logits[pad.view(-1)]
    p = compute_probs(logits, *sampling_tensors([seq.params for seq in seqs], K + 1, logits.device))
    p = p.view(B, K + 1, -1).cpu()
    depths = [tree.depth.tolist() if tree is not None else list(range(1, K + 1)) for tree in trees]
    positions = [[len(seq)] + [len(seq) + x for x in dep] + [len(seq)] * (K - len(dep))
                 for seq, dep in zip(seqs, depths)]
    u = position_uniforms([seq.seed for seq in seqs], positions)                              # [B, K+1]
    return sample_from_probs(p.view(B * (K + 1), -1), u.view(-1)).view(B, K + 1), p


def accept_chains(y: torch.Tensor, p: torch.Tensor | None, drafts: list[list[int]], qs: list[torch.Tensor | None],
                  seqs: list[Sequence]) -> list[list[int]]:
    """Chain drafts (possibly empty) -> the tokens each commits. y [C, K+1] and p [C, K+1, V] (None: greedy) from
    draw_target; qs[c] [len(drafts[c]), V'] when drafts[c] was sampled from q. A draft is accepted while it equals
    the target's draw (exact for deterministic drafts); one sampled from q takes the rejection rule instead."""
    C, K = y.shape[0], y.shape[1] - 1
    if K == 0:                         # no drafts this step: each row's draw is its token
        return [[token] for token in y[:, 0].tolist()]
    draft_tokens = torch.tensor([d + [0] * (K - len(d)) for d in drafts], dtype=torch.int64).view(C, K)
    num_draft_tokens = torch.tensor([len(d) for d in drafts])
    out, num = verify_greedy(y, draft_tokens, num_draft_tokens)
    sampled_q = [c for c, q in enumerate(qs) if q is not None and p is not None]
    if sampled_q:                      # the rejection rule (Leviathan et al.) on those rows
        q = torch.zeros(len(sampled_q), K, p.shape[-1])
        for r, c in enumerate(sampled_q):
            q[r, :len(drafts[c])] = qs[c][:, :p.shape[-1]].cpu()
        seeds = [seqs[c].seed for c in sampled_q]
        starts = [[len(seqs[c]) + j for j in range(K + 1)] for c in sampled_q]
        u_accept = position_uniforms(seeds, [s[:K] for s in starts], stream=1)
        u_sample = position_uniforms(seeds, starts)
        out_q, num_q = verify_rejection(p[sampled_q], draft_tokens[sampled_q], num_draft_tokens[sampled_q], q,
                                        u_accept, u_sample)
        out[sampled_q], num[sampled_q] = out_q, num_q
    return [row[:n] for row, n in zip(out.tolist(), num.tolist())]


def accept_tree_draft(y: torch.Tensor, tree: Tree, token_ids: list[int]) -> tuple[list[int], list[int]]:
    """y [>= n+1], the target's draws at the root and after each node -> (the tokens committed: the accepted
    path's, then the target's draw at its end; the path's node indices from the root down)."""
    n = len(token_ids)
    accepted, final = accept_tree(y[None, :n + 1], tree, torch.tensor([token_ids]))
    path = accepted[0].nonzero().squeeze(1).tolist()
    return [token_ids[j] for j in path] + [int(final[0])], path


def committed_rows(scheduled: list[ScheduledSeq], offsets: list[int], tokens: list[list[int] | None],
                   paths: dict[int, list[int]]) -> list[list[int]]:
    """The rows of hidden whose tokens each sequence committed: its new tokens, then a chain's accepted
    draft tokens (all but the last committed token, which has no row yet) or a tree's accepted path."""
    rows = []
    for i, s in enumerate(scheduled):
        base = offsets[i]
        if i in paths:
            rows.append(list(range(base, base + s.num_new)) + [base + s.num_new + j for j in paths[i]])
        else:
            num_valid = s.num_new + (len(tokens[i]) - 1 if tokens[i] else 0)
            rows.append(list(range(base, base + num_valid)))
    return rows
