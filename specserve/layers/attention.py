from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def kv_cache_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """bf16 models on CPU keep K/V in fp32 (the exact bf16 values): attention runs in fp32 there
    (paged_attention), and a bf16 cache would be converted again at every layer of every step."""
    return torch.float32 if dtype == torch.bfloat16 and torch.device(device).type == "cpu" else dtype


@dataclass(slots=True)
class RowByRow:
    """A sequence whose new tokens are each attended on their own, with exactly the call a one-token decode
    step makes for that token (one query, over just the slots it sees, no mask). torch's CPU attention rounds a
    row differently with the rows computed beside it and with masked padding (last fp32 bits, which a bf16
    model's rounding can turn into another token at a near tie), so this is what keeps a verify step's rows,
    and a batch's, bit-identical to plain decoding of one sequence alone."""
    first: int                                  # flat row of its first new token
    seen: list[int | torch.Tensor]              # per new token: how many context entries it sees (a prefix),
    #                                             or which ones, in order (a tree node: context, ancestors, itself)
    num_slots: int                              # its context: cached tokens and new ones
    run_start: int | None                       # its context is one run of cache slots from here: read in place
    slots: torch.Tensor | None                  # else its context slots in order, gathered once a layer


@dataclass(slots=True)
class ForwardContext:
    """Everything one paged forward needs besides the token ids. Built once per forward by the
    model runner and passed explicitly: a target and a drafter run in one process.

    The N new tokens are packed flat. Their K/V are written to `slot_mapping` first, then each
    sequence attends to its `context_slots` (which include its new tokens), masked by `attn_mask`.
    A single sequence whose slots are one run [context_start, context_start + T) is read in place.
    """
    positions: torch.Tensor                 # [N] int64, rotary position of each new token
    slot_mapping: torch.Tensor              # [N] int64, flat cache slot each new token's K/V goes to
    context_slots: torch.Tensor             # [B, T] int64, slots each sequence attends to, padded
    attn_mask: torch.Tensor | None          # [B, 1, Q, T] bool; None: every query sees all T slots
    query_index: torch.Tensor | None        # [B, Q] flat row of each padded query; None when B == 1
    output_index: torch.Tensor | None       # [N] row of each flat token in the padded [B * Q] output
    kv_cache: torch.Tensor                  # [L, S, 2, kv_heads, head_dim] (a view of head-major storage)
    context_start: int | None = None        # B == 1 and its slots contiguous: the first one (no gather)
    row_by_row: list[RowByRow] | None = None  # sequences attended token by token; all of them: no batched call


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]. Writes k/v into the cache, then attends."""
    cache = ctx.kv_cache[layer]                                                         # [S, 2, Hkv, D]
    B, T = ctx.context_slots.shape
    if ctx.row_by_row is not None and len(ctx.row_by_row) == B:
        if ctx.context_start is not None:
            cache[ctx.context_start + T - k.shape[0]:ctx.context_start + T].copy_(torch.stack((k, v), dim=1))
        else:
            cache.index_copy_(0, ctx.slot_mapping, torch.stack((k, v), dim=1).to(cache.dtype))
        return attend_row_by_row(q, cache, ctx.row_by_row, q.new_empty(q.shape))
    if ctx.context_start is not None:       # a view of the cache: reading 4k slots in place saves a 6 MB copy a layer
        run = cache[ctx.context_start:ctx.context_start + T]                            # [T, 2, Hkv, D]
        run[T - k.shape[0]:].copy_(torch.stack((k, v), dim=1))          # the new tokens are the run's last slots
        kv = run.unsqueeze(0)                                                           # [1, T, 2, Hkv, D]
        keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)       # [1, Hkv, T, D] views
    else:
        cache.index_copy_(0, ctx.slot_mapping, torch.stack((k, v), dim=1).to(cache.dtype))
        Hkv, D = k.shape[1:]
        kv = cache.index_select(0, ctx.context_slots.view(-1)).view(B, T, 2 * Hkv, D).transpose(1, 2)
        keys, values = kv.chunk(2, dim=1)                                               # [B, Hkv, T, D] each
    queries = q.unsqueeze(0) if ctx.query_index is None else q[ctx.query_index]          # [B, Q, Hq, D]
    B, Q, Hq, D = queries.shape
    Hkv, G = keys.shape[1], Hq // keys.shape[1]
    # the G query heads sharing a K/V head become G * Q rows of one head: each K/V head is read once, where
    # enable_gqa reads it once per query head (at 4k slots: 304 vs 371 us a layer, one thread)
    queries = queries.view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D)
    mask = ctx.attn_mask if ctx.attn_mask is None or G == 1 else ctx.attn_mask.repeat(1, 1, G, 1)
    # a bf16 model on CPU has an fp32 cache (runtime/model_runner.py) and attends in fp32: torch's CPU attention
    # kernels are 6-8x slower in bf16 than in fp32 here (84 vs 13 us for one decode query over 250 slots)
    upcast = queries.dtype != keys.dtype
    out = F.scaled_dot_product_attention(queries.to(keys.dtype) if upcast else queries, keys, values, attn_mask=mask)
    if upcast:
        out = out.to(q.dtype)
    out = out.view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4)                              # [B, Q, Hkv, G, D]
    out = out.reshape(q.shape) if ctx.output_index is None else \
        out.reshape(-1, *q.shape[1:]).index_select(0, ctx.output_index)
    # a step mixing prompt chunks with decoding sequences: the latter's rows again, one by one (written above)
    return out if ctx.row_by_row is None else attend_row_by_row(q, cache, ctx.row_by_row, out)


def attend_row_by_row(q: torch.Tensor, cache: torch.Tensor, items: list[RowByRow], out: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D] -> out [N, Hq, D], each listed row as a decode step computes it (K/V already written)."""
    Hkv, D = cache.shape[2:]
    G = q.shape[1] // Hkv
    for item in items:
        kv = cache[item.run_start:item.run_start + item.num_slots] if item.run_start is not None else \
            cache.index_select(0, item.slots)                                         # [T, 2, Hkv, D]
        for r, seen in enumerate(item.seen):
            part = kv[:seen] if isinstance(seen, int) else kv.index_select(0, seen)
            keys, values = part[:, 0].transpose(0, 1).unsqueeze(0), part[:, 1].transpose(0, 1).unsqueeze(0)
            query = q[item.first + r].view(1, Hkv, G, D)                               # the G heads of a K/V head
            o = F.scaled_dot_product_attention(query.to(keys.dtype), keys, values)      # [1, Hkv, G, D]
            out[item.first + r] = o.view(-1, D).to(out.dtype)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Cache-free causal attention for training: q [B, T, Hq, D], k/v [B, T, Hkv, D]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)
