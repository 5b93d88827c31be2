"""Runs one model over a packed batch of new tokens against its own paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specserve.config import MAX_NUM_ASSISTANT_TOKENS
from specserve.layers.attention import BatchedCall, ForwardContext, NativeChains, RowByRow, kv_cache_dtype
from specserve.layers.kernels import NATIVE_CACHE_DTYPES, attend_row_library
from specserve.runtime.device import FORWARD_THREADS

# with row_by_row (the target's runner), a sequence with at most this many new tokens (a decode or verify step:
# the last token and its drafts) is attended token by token, bit-identical to plain decoding (layers/attention.py,
# RowByRow); longer prompt chunks in one batched call. Drafters whose forwards edit the mask (EAGLE3) keep it off.
ROW_BY_ROW_MAX_TOKENS = 1 + MAX_NUM_ASSISTANT_TOKENS
NO_SLOTS = np.zeros(1, dtype=np.int64)


@dataclass(slots=True)
class ForwardItem:
    """The new tokens of one sequence in one forward."""
    block_table: list[int]
    start: int                               # cache index of the first new token; [0, start) are cached
    token_ids: list[int]
    positions: list[int] | None = None       # rotary positions; None: start, start + 1, ...
    tree_mask: torch.Tensor | None = None    # [n, n] bool among the new tokens; None: causal chain
    context_from: int = 0                    # cache indices before it are not attended (a drafter's empty slots)


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             device: torch.device | str, kind: str = "auto") -> int:
    """K and V of every layer and head; an int8 cache also keeps an fp32 scale for each."""
    element = torch.empty((), dtype=kv_cache_dtype(dtype, device, kind)).element_size()
    return 2 * num_layers * num_kv_heads * (head_dim * element + (4 if kind == "int8" else 0))


class ModelRunner:
    def __init__(self, model: nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 row_by_row: bool = False, kv_kind: str = "auto"):
        self.model = model
        self.row_by_row = row_by_row            # the target's runner: decode and verify rows exactly as decoded alone
        self.block_size = block_size
        self.device = torch.device(device)
        # stored head-major ([L, 2, Hkv, S, D]: one head's K of a run of slots is one contiguous stretch, which
        # attention reads from memory 1.5x faster than rows strided by a whole slot), indexed through the
        # [L, S, 2, Hkv, D] view: a slot's K and V are still written and read as one [2, Hkv, D] element
        storage = torch.zeros(num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim,
                              dtype=kv_cache_dtype(dtype, self.device, kv_kind), device=self.device)
        self.kv_cache = storage.permute(0, 3, 1, 2, 4)
        # an int8 cache's scales, one a token, head and K or V: [L, 2, Hkv, S] viewed as [L, S, 2, Hkv]
        self.kv_scales = None if kv_kind != "int8" else torch.ones(
            num_layers, 2, num_kv_heads, num_blocks * block_size, device=self.device).permute(0, 3, 1, 2)
        self._arange = np.arange(1 << 16)
        # built (once per machine) now, not inside a timed first step; it takes heads of a multiple of 32
        # a drafter's runner too: its decode-shaped rows (a catch-up over a few committed tokens, a chain's next draft
        # token) in the native kernel, not a masked batched call (EAGLE3's head: 0.22-0.37 ms a forward at ~600 slots)
        self.native_rows = storage.device.type == "cpu" and storage.dtype in NATIVE_CACHE_DTYPES \
            and attend_row_library() is not None and head_dim % 32 == 0

    def slots(self, block_table: list[int], begin: int, end: int) -> np.ndarray:
        idx = self._arange[begin:end] if end <= len(self._arange) else np.arange(begin, end)
        table = np.asarray(block_table, dtype=np.int64)
        return table[idx // self.block_size] * self.block_size + idx % self.block_size

    def slots_at(self, block_table: list[int], indices: list[int]) -> torch.Tensor:
        idx = np.asarray(indices, dtype=np.int64)
        table = np.asarray(block_table, dtype=np.int64)
        return torch.from_numpy(table[idx // self.block_size] * self.block_size + idx % self.block_size).to(self.device)

    def contiguous_start(self, block_table: list[int], num_slots: int) -> int | None:
        """The first slot if the first num_slots slots of the table are one run (its blocks follow each other)."""
        n = -(-num_slots // self.block_size)
        first = block_table[0]
        return first * self.block_size if block_table[:n] == list(range(first, first + n)) else None

    def move_kv(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        """Copy the K/V of cache indices src to dst (all layers), e.g. an accepted tree path."""
        s, d = self.slots_at(block_table, src), self.slots_at(block_table, dst)
        self.kv_cache[:, d] = self.kv_cache[:, s]
        if self.kv_scales is not None:
            self.kv_scales[:, d] = self.kv_scales[:, s]

    def prepare(self, items: list[ForwardItem], native: bool = True) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """The forward's inputs and plan. native=False: no native plan, for a caller that edits the calls' masks."""
        ids, positions, slot_mapping, contexts = [], [], [], []
        lens = [len(it.token_ids) for it in items]
        firsts = np.cumsum([0] + lens[:-1])
        for it, n in zip(items, lens):
            ids.extend(it.token_ids)
            positions.extend(it.positions if it.positions is not None else range(it.start, it.start + n))
            contexts.append(self.slots(it.block_table, 0, it.start + n))
            slot_mapping.append(contexts[-1][it.start:])
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        slots = np.concatenate(slot_mapping)
        # decode and verify rows (a few tokens a sequence) apart from prompt chunks: padded into one call with a
        # prompt chunk, each short sequence would cost as much attention as the chunk (3.6x a 256-token chunk's
        # cost beside 7 decoding sequences); the target's runner attends the short ones row by row
        short = [b for b, n in enumerate(lens) if n <= ROW_BY_ROW_MAX_TOKENS]
        long = [b for b, n in enumerate(lens) if n > ROW_BY_ROW_MAX_TOKENS]
        row_by_row = [self.rows_of(items[b], int(firsts[b]), contexts[b]) for b in short] if self.row_by_row else []
        groups = [g for g in ([long] if self.row_by_row else [short, long]) if g]
        whole = len(groups) == 1 and len(groups[0]) == len(items)
        calls = [self.batched_call(items, g, lens, firsts, contexts, whole) for g in groups]
        ctx = ForwardContext(
            positions=positions_t,
            slot_mapping=torch.from_numpy(slots).to(dev),
            kv_cache=self.kv_cache,
            kv_scales=self.kv_scales,
            calls=calls,
            row_by_row=row_by_row or None,
            write_start=int(slots[0]) if len(slots) == 1 or np.all(np.diff(slots) == 1) else None,
            chains=self.native_chains(items, firsts, row_by_row, contexts) if self.native_rows and native and not long
            else None,
        )
        return input_ids, positions_t, ctx

    def native_chains(self, items: list[ForwardItem], firsts: np.ndarray, rows: list[RowByRow],
                      contexts: list[np.ndarray]) -> NativeChains | None:
        """The native kernel's plan for a forward of decode and verify rows only (no tree: its rows see
        scattered entries, which attend_row_by_row handles). rows: the target's RowByRow plan (a drafter's runner
        has none); a drafter's context starts at its context_from. Built on every step: plain lists, one array each."""
        seqs, paged, offset = [], [], 0
        for b, (it, context) in enumerate(zip(items, contexts)):
            skip = it.context_from
            if it.tree_mask is not None or skip > it.start:
                return None
            run_start = rows[b].run_start if rows else self.contiguous_start(it.block_table, len(context))
            if run_start is None:
                seqs += (int(firsts[b]), len(it.token_ids), it.start - skip, -1, offset)
                paged.append(context[skip:])
                offset += len(context) - skip
            else:
                seqs += (int(firsts[b]), len(it.token_ids), it.start - skip, run_start + skip, 0)
        return NativeChains(np.array(seqs, dtype=np.int64).reshape(-1, 5),
                            np.concatenate(paged) if paged else NO_SLOTS, torch.get_num_threads())

    def batched_call(self, items: list[ForwardItem], group: list[int], lens: list[int], firsts: np.ndarray,
                     contexts: list[np.ndarray], whole: bool) -> BatchedCall:
        """The items `group` (indices) attended in one call, each padded to the longest; whole: they are all
        the forward's items, in order (their rows need no index)."""
        dev = self.device
        B, Q, T = len(group), max(lens[b] for b in group), max(len(contexts[b]) for b in group)
        context_slots = np.zeros((B, T), dtype=np.int64)
        for i, b in enumerate(group):
            context_slots[i, :len(contexts[b])] = contexts[b]
        attn_mask = query_index = output_index = rows = None
        if B > 1 or Q > 1 or any(items[b].context_from for b in group):
            starts = torch.tensor([items[b].start for b in group], dtype=torch.int64)
            ends = torch.tensor([len(contexts[b]) for b in group])
            last_visible = (starts[:, None] + torch.arange(Q)[None, :]).clamp_max(ends[:, None] - 1)
            attn_mask = torch.arange(T)[None, None, :] <= last_visible[:, :, None]          # [B, Q, T]
            for i, b in enumerate(group):
                if items[b].tree_mask is not None:
                    attn_mask[i, :lens[b], items[b].start:items[b].start + lens[b]] = items[b].tree_mask
                attn_mask[i, :, :items[b].context_from] = False
            attn_mask = attn_mask.unsqueeze(1).to(dev)                                      # [B, 1, Q, T]
        if B > 1 or not whole:
            glens, gfirsts = np.asarray([lens[b] for b in group]), firsts[group]
            qi = np.minimum(np.arange(Q)[None, :], glens[:, None] - 1) + gfirsts[:, None]
            query_index = torch.from_numpy(qi).to(dev)
            output_index = torch.from_numpy(np.concatenate([i * Q + np.arange(n) for i, n in enumerate(glens)])).to(dev)
            if not whole:
                rows = torch.from_numpy(np.concatenate([f + np.arange(n) for f, n in zip(gfirsts, glens)])).to(dev)
        return BatchedCall(torch.from_numpy(context_slots).to(dev), attn_mask, query_index, output_index,
                           self.contiguous_start(items[group[0]].block_table, T) if B == 1 else None, rows, group)

    def rows_of(self, item: ForwardItem, first: int, slots: np.ndarray) -> RowByRow:
        """What each new token of `item` sees: a prefix of its context, or (a tree node) the cached tokens, its
        ancestors and itself, in order."""
        n, start = len(item.token_ids), item.start
        if item.tree_mask is None:
            seen = list(range(start + 1, start + n + 1))
        else:
            cached = torch.arange(start, device=self.device)
            seen = [torch.cat((cached, start + torch.nonzero(row).view(-1).to(self.device))) for row in item.tree_mask]
        run_start = self.contiguous_start(item.block_table, start + n)
        return RowByRow(first, seen, start + n, run_start,
                        None if run_start is not None else torch.from_numpy(slots).to(self.device))

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final hidden states [N, H] of all new tokens (flat, item after item) and aux."""
        FORWARD_THREADS.fit(sum(len(it.token_ids) for it in items))     # before prepare: its kernels plan by threads
        input_ids, positions, ctx = self.prepare(items)
        return self.model(input_ids, positions, ctx, aux_layers)
