"""Runs one model over a packed batch of new tokens against its own paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specserve.config import MAX_NUM_ASSISTANT_TOKENS
from specserve.layers.attention import ForwardContext, RowByRow, kv_cache_dtype
from specserve.layers.kernels import attend_row_library

# with row_by_row (the target's runner), a sequence with at most this many new tokens (a decode or verify step:
# the last token and its drafts) is attended token by token, bit-identical to plain decoding (layers/attention.py,
# RowByRow); longer prompt chunks in one batched call. Drafters whose forwards edit the mask (EAGLE3) keep it off.
ROW_BY_ROW_MAX_TOKENS = 1 + MAX_NUM_ASSISTANT_TOKENS


@dataclass(slots=True)
class ForwardItem:
    """The new tokens of one sequence in one forward."""
    block_table: list[int]
    start: int                               # cache index of the first new token; [0, start) are cached
    token_ids: list[int]
    positions: list[int] | None = None       # rotary positions; None: start, start + 1, ...
    tree_mask: torch.Tensor | None = None    # [n, n] bool among the new tokens; None: causal chain


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             device: torch.device | str) -> int:
    element = torch.empty((), dtype=kv_cache_dtype(dtype, device)).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * element


class ModelRunner:
    def __init__(self, model: nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 row_by_row: bool = False):
        self.model = model
        self.row_by_row = row_by_row            # the target's runner: decode and verify rows exactly as decoded alone
        self.block_size = block_size
        self.device = torch.device(device)
        # stored head-major ([L, 2, Hkv, S, D]: one head's K of a run of slots is one contiguous stretch, which
        # attention reads from memory 1.5x faster than rows strided by a whole slot), indexed through the
        # [L, S, 2, Hkv, D] view: a slot's K and V are still written and read as one [2, Hkv, D] element
        storage = torch.zeros(num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim,
                              dtype=kv_cache_dtype(dtype, self.device), device=self.device)
        self.kv_cache = storage.permute(0, 3, 1, 2, 4)
        self._arange = np.arange(1 << 16)
        if storage.device.type == "cpu" and storage.dtype == torch.bfloat16:
            attend_row_library()                # built (once per machine) now, not inside a timed first step

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

    def prepare(self, items: list[ForwardItem]) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        ids, positions, slot_mapping, row_by_row = [], [], [], []
        lens = [len(it.token_ids) for it in items]
        ctx_lens = [it.start + n for it, n in zip(items, lens)]
        B, Q, T = len(items), max(lens), max(ctx_lens)
        context_slots = np.zeros((B, T), dtype=np.int64)
        for b, it in enumerate(items):
            n = lens[b]
            ids.extend(it.token_ids)
            positions.extend(it.positions if it.positions is not None else range(it.start, it.start + n))
            ctx = self.slots(it.block_table, 0, ctx_lens[b])
            context_slots[b, :ctx_lens[b]] = ctx
            slot_mapping.append(ctx[it.start:])
            if self.row_by_row and n <= ROW_BY_ROW_MAX_TOKENS:
                row_by_row.append(self.rows_of(it, len(ids) - n, ctx))
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        has_tree = any(it.tree_mask is not None for it in items)
        batched = len(row_by_row) < B           # some tokens attend in one batched call: it needs mask and indices
        if (B == 1 and Q == 1) or not batched:
            attn_mask = None
        else:
            starts = torch.tensor([it.start for it in items], dtype=torch.int64)
            last_visible = (starts[:, None] + torch.arange(Q)[None, :]).clamp_max(torch.tensor(ctx_lens)[:, None] - 1)
            attn_mask = torch.arange(T)[None, None, :] <= last_visible[:, :, None]          # [B, Q, T]
            if has_tree:
                for b, it in enumerate(items):
                    if it.tree_mask is not None:
                        n = lens[b]
                        attn_mask[b, :n, it.start:it.start + n] = it.tree_mask
            attn_mask = attn_mask.unsqueeze(1).to(dev)                                      # [B, 1, Q, T]
        if B == 1 or not batched:
            query_index = output_index = None
        else:
            offsets = np.cumsum([0] + lens[:-1])
            qi = np.minimum(np.arange(Q)[None, :], np.asarray(lens)[:, None] - 1) + offsets[:, None]
            query_index = torch.from_numpy(qi).to(dev)
            output_index = torch.from_numpy(np.concatenate([b * Q + np.arange(n) for b, n in enumerate(lens)])).to(dev)
        ctx = ForwardContext(
            positions=positions_t,
            slot_mapping=torch.from_numpy(np.concatenate(slot_mapping)).to(dev),
            context_slots=torch.from_numpy(context_slots).to(dev),
            attn_mask=attn_mask,
            query_index=query_index,
            output_index=output_index,
            kv_cache=self.kv_cache,
            context_start=self.contiguous_start(items[0].block_table, T) if B == 1 else None,
            row_by_row=row_by_row or None,
        )
        return input_ids, positions_t, ctx

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
        input_ids, positions, ctx = self.prepare(items)
        return self.model(input_ids, positions, ctx, aux_layers)
