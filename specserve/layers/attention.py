from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specserve.layers.kernels import NATIVE_CACHE_DTYPES, attend_chains_native, attend_row_library, attend_row_native
from specserve.layers.linear import bf16_packing_supported


KV_CACHE_DTYPES = ("auto", "int8")


def kv_cache_dtype(dtype: torch.dtype, device: torch.device | str, kind: str = "auto") -> torch.dtype:
    """"auto": bf16 models keep K/V in bf16, except on a CPU without native bf16 products (AVX2 only), where they
    are kept in fp32 (the exact bf16 values) and attention runs in fp32: bf16 products are emulated there.
    "int8" (`--kv-cache-dtype int8`): int8 values with an fp32 scale per token and head (quantize_kv)."""
    if kind == "int8":
        return torch.int8
    cpu = torch.device(device).type == "cpu"
    return torch.float32 if dtype == torch.bfloat16 and cpu and not bf16_packing_supported() else dtype


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> int8 [..., D] and fp32 scales [...]: scale = max |x| / 127 (1 for zeros), values round(x /
    scale), ties to even. The native kernel's writes (quantize_row in kernels/attend_row.c) take the same fp32
    operations, so a token's K/V have the same bits whichever path wrote them."""
    x = x.float()
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / scale.unsqueeze(-1)).to(torch.int8), scale


def dequantize_kv(kv: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """kv [..., D] and its scales [...] (None: kv as it is) -> fp32 [..., D]."""
    return kv if scales is None else kv.float() * scales.unsqueeze(-1)


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
class NativeChains:
    """Every new row of the forward is a decode or verify row of a chain (no tree, no prompt chunk) and the
    cache is bf16 on an AVX-512 CPU: one native call a layer writes their K/V and attends them all, each row as
    the one-row kernel attends it alone (the same bits as attend_row_by_row, without its Python per row)."""
    seqs: np.ndarray                        # [n, 5] int64: first row, rows, cached tokens, run's first slot or -1,
    #                                         offset of its context in `slots`
    slots: np.ndarray                       # int64: the context slots of the sequences that are not one run
    num_threads: int
    addresses: tuple[int, int] = (0, 0)     # of seqs and slots, taken once (numpy's .ctypes costs ~2 us)

    def __post_init__(self):
        self.addresses = (self.seqs.ctypes.data, self.slots.ctypes.data)


@dataclass(slots=True)
class BatchedCall:
    """Sequences attended in one padded call: each attends its `context_slots` (which include its new tokens),
    masked by `attn_mask`. One sequence whose slots are one run [context_start, context_start + T) is read in
    place."""
    context_slots: torch.Tensor             # [B, T] int64, slots each sequence attends to, padded
    attn_mask: torch.Tensor | None          # [B, 1, Q, T] bool; None: every query sees all T slots
    query_index: torch.Tensor | None        # [B, Q] flat row of each padded query; None: B == 1, all the rows
    output_index: torch.Tensor | None       # row of each of its tokens in the padded [B * Q] output
    context_start: int | None               # B == 1 and its slots contiguous: the first one (no gather)
    rows: torch.Tensor | None               # flat rows of its tokens; None: every row of the forward
    items: list[int]                        # which of the forward's items it holds, in order


@dataclass(slots=True)
class ForwardContext:
    """Everything one paged forward needs besides the token ids. Built once per forward by the
    model runner and passed explicitly: a target and a drafter run in one process.

    The N new tokens are packed flat. Their K/V are written to `slot_mapping` first, then each sequence
    attends: in a batched call (prompt chunks apart from the few-token rows of decoding sequences, so that
    neither is padded to the other), or row by row (the target's decode and verify rows).
    """
    positions: torch.Tensor                 # [N] int64, rotary position of each new token
    slot_mapping: torch.Tensor              # [N] int64, flat cache slot each new token's K/V goes to
    kv_cache: torch.Tensor                  # [L, S, 2, kv_heads, head_dim] (a view of head-major storage)
    kv_scales: torch.Tensor | None          # an int8 cache's scales [L, S, 2, kv_heads] (head-major too); else None
    calls: list[BatchedCall]
    row_by_row: list[RowByRow] | None = None  # sequences attended token by token, in no call
    write_start: int | None = None          # the new tokens' slots are one run from here: written as one copy
    chains: NativeChains | None = None      # set where the native kernel can take every row (row_by_row too)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return paged_attention(q, k, v, self, layer)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]. Writes k/v into the cache, then attends."""
    cache = ctx.kv_cache[layer]                                                         # [S, 2, Hkv, D]
    scales = None if ctx.kv_scales is None else ctx.kv_scales[layer]                    # [S, 2, Hkv]
    if (chains := ctx.chains) is not None and (out := attend_chains_native(
            q, k, v, cache, scales, chains.addresses[0], len(chains.seqs), chains.addresses[1], chains.num_threads)) is not None:
        return out
    new_kv = torch.stack((k, v), dim=1)
    writes = [(cache, new_kv.to(cache.dtype))] if scales is None else list(zip((cache, scales), quantize_kv(new_kv)))
    for dst, src in writes:
        if ctx.write_start is not None:
            dst[ctx.write_start:ctx.write_start + k.shape[0]].copy_(src)
        else:
            dst.index_copy_(0, ctx.slot_mapping, src)
    if len(ctx.calls) == 1 and ctx.calls[0].rows is None:
        out = batched_attention(q, cache, ctx.calls[0], scales)
    else:
        out = q.new_empty(q.shape)
        for call in ctx.calls:
            out[call.rows] = batched_attention(q, cache, call, scales)
    # decoding sequences' rows (beside prompt chunks, or all of them), one by one
    return out if ctx.row_by_row is None else attend_row_by_row(q, cache, ctx.row_by_row, out, scales)


def batched_attention(q: torch.Tensor, cache: torch.Tensor, call: BatchedCall, scales: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """The call's rows of q [N, Hq, D], in order, each sequence padded to the longest (an int8 cache's context
    dequantized with its `scales` first)."""
    B, T = call.context_slots.shape
    if call.context_start is not None:      # a view of the cache: reading 4k slots in place saves a 6 MB copy a layer
        run = slice(call.context_start, call.context_start + T)
        kv = dequantize_kv(cache[run], None if scales is None else scales[run]).unsqueeze(0)  # [1, T, 2, Hkv, D]
        keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)       # [1, Hkv, T, D] views
    else:
        Hkv, D = cache.shape[2:]
        slots = call.context_slots.view(-1)
        kv = dequantize_kv(cache.index_select(0, slots), None if scales is None else scales.index_select(0, slots))
        keys, values = kv.view(B, T, 2 * Hkv, D).transpose(1, 2).chunk(2, dim=1)       # [B, Hkv, T, D] each
    queries = q.unsqueeze(0) if call.query_index is None else q[call.query_index]        # [B, Q, Hq, D]
    B, Q, Hq, D = queries.shape
    Hkv, G = keys.shape[1], Hq // keys.shape[1]
    # the G query heads sharing a K/V head become G * Q rows of one head: each K/V head is read once, where
    # enable_gqa reads it once per query head (at 4k slots: 304 vs 371 us a layer, one thread)
    queries = queries.view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D)
    mask = call.attn_mask if call.attn_mask is None or G == 1 else call.attn_mask.repeat(1, 1, G, 1)
    # a bf16 model attends in fp32 on CPU, as it did when its cache was fp32 (prompt chunks: as fast as in bf16)
    work = torch.float32 if keys.device.type == "cpu" else keys.dtype
    out = F.scaled_dot_product_attention(queries.to(work), keys.to(work), values.to(work), attn_mask=mask)
    out = out.to(q.dtype).view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4)                 # [B, Q, Hkv, G, D]
    return out.reshape(-1, *q.shape[1:]) if call.output_index is None else \
        out.reshape(-1, *q.shape[1:]).index_select(0, call.output_index)


# a row that sees at least this many slots of a bf16 cache on CPU attends with two bf16 matrix products (oneDNN,
# fp32 accumulation); below it, fp32 SDPA over the slots upcast is faster (fixed costs of oneDNN's calls)
BF16_PRODUCTS_MIN_SLOTS = 768


def attend_row_by_row(q: torch.Tensor, cache: torch.Tensor, items: list[RowByRow], out: torch.Tensor,
                      scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D] -> out [N, Hq, D], each listed row as a decode step computes it (K/V already written).
    A row's bits depend only on its query and the K/V it sees, in order: the native kernel reads its slots where
    they lie; torch's kernels read them head-major (in place, or gathered into that layout), so in place and
    gathered give the same products."""
    Hkv, D = cache.shape[2:]
    G = q.shape[1] // Hkv
    heads = cache.permute(1, 2, 0, 3)                 # [2, Hkv, S, D]: the storage's own order (model_runner.py)
    head_scales = None if scales is None else scales.permute(1, 2, 0)                  # [2, Hkv, S]
    native = heads.device.type == "cpu" and heads.dtype in NATIVE_CACHE_DTYPES and attend_row_library() is not None
    for item in items:
        kv = None
        for r, seen in enumerate(item.seen):
            row, query = item.first + r, q[item.first + r].view(Hkv, G, D)
            result = attend_in_place(query, heads, head_scales, item, seen) if native else None
            if result is None:
                if kv is None:
                    run = slice(item.run_start, item.run_start + item.num_slots) if item.run_start is not None else None
                    pick = (lambda t: t[:, :, run]) if run is not None else (lambda t: t.index_select(2, item.slots))
                    kv = dequantize_kv(pick(heads), None if head_scales is None else pick(head_scales))  # [2, Hkv, T, D]
                keys, values = kv[:, :, :seen] if isinstance(seen, int) else kv.index_select(2, seen)
                result = attend_one_row(query, keys, values)
            out[row] = result.view(-1, D)
    return out


def attend_in_place(query: torch.Tensor, heads: torch.Tensor, head_scales: torch.Tensor | None, item: RowByRow,
                    seen: int | torch.Tensor) -> torch.Tensor | None:
    """The native kernel over the row's context where it lies in the cache: a run's prefix as a view, any
    other context through its slot numbers (no gather)."""
    if item.run_start is not None and isinstance(seen, int):
        run = slice(item.run_start, item.run_start + seen)
        return attend_row_native(query, heads[0, :, run], heads[1, :, run],
                                 scales=None if head_scales is None else (head_scales[0, :, run], head_scales[1, :, run]))
    if item.run_start is not None:
        slots = item.run_start + seen
    else:
        slots = item.slots[:seen] if isinstance(seen, int) else item.slots[seen]
    return attend_row_native(query, heads[0], heads[1], slots,
                             scales=None if head_scales is None else (head_scales[0], head_scales[1]))


def attend_one_row(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """query [Hkv, G, D] (the G query heads of each K/V head), keys/values [Hkv, T, D] -> [Hkv, G, D]."""
    T, D = keys.shape[1:]
    if (out := attend_row_native(query, keys, values)) is not None:   # one pass in C (layers/kernels/attend_row.c)
        return out
    if keys.device.type == "cpu" and keys.dtype == torch.bfloat16 and T >= BF16_PRODUCTS_MIN_SLOTS:
        # scores as [T, G] per head: oneDNN's bf16 product with the T slots as rows reads K as stored (with T
        # as columns it reorders K first: 4x slower); softmax in fp32 along the last dimension (along a
        # middle one torch's kernel is 4x slower), then probabilities in bf16 times V, as torch's bf16 SDPA does
        scores = torch.matmul(keys, query.transpose(1, 2))                              # [Hkv, T, G]
        probs = torch.softmax(scores.transpose(1, 2).float().mul_(D ** -0.5), dim=-1)   # [Hkv, G, T]
        return torch.matmul(probs.to(values.dtype), values)
    # torch's CPU SDPA runs 6-8x slower in bf16 than in fp32 for one row (84 vs 13 us over 250 slots)
    work = torch.float32 if keys.device.type == "cpu" else keys.dtype
    out = F.scaled_dot_product_attention(query.to(work)[None], keys.to(work)[None], values.to(work)[None])[0]
    return out.to(query.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Cache-free causal attention for training: q [B, T, Hq, D], k/v [B, T, Hkv, D]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)
