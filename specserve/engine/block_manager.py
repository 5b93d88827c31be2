"""Paged KV-cache accounting: reference-counted blocks with prefix caching.

Only full blocks of committed tokens are hashed; a block's hash chains from the previous block's,
so equal hashes mean equal whole prefixes. Freed blocks keep their hash until they are reused,
which is what makes a later request with the same prefix a cache hit.

A drafter with its own cache (EAGLE3's head, MTP's layers, a draft model) fills it only for sequences that
draft, so a block is registered once the target's K/V are in, and marked `drafter_valid` once the drafter's
are too (a drafter-valid block wins a hash over a target-only one). A hit's leading drafter-valid blocks are
what the drafter resumes from; past them it catches up, or restarts there (drafting/catch_up.py).
"""
from __future__ import annotations

from collections import deque

from specserve.runtime.sequence import Sequence


class NoFreeBlocks(RuntimeError):
    pass


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "drafter_valid")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: tuple[int, ...] = ()
        self.drafter_valid = False


def chain_hash(prev_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))   # reused from the left (oldest first)
        self.hash_to_block: dict[int, int] = {}
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation -------------------------------------------------------------------------
    def _take_free_block(self, prefer: int | None = None) -> int:
        """The oldest free block, or `prefer` if it is free: a sequence whose blocks follow each other holds
        its K/V in one run of slots, which attention reads in place instead of gathering it every step."""
        if not self.free_block_ids:
            raise NoFreeBlocks("KV cache is out of blocks")
        if prefer is not None and prefer < len(self.blocks) and self.blocks[prefer].ref_count == 0:
            self.free_block_ids.remove(prefer)
            block_id = prefer
        else:
            block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count, block.drafter_valid = -1, (), 1, False
        return block_id

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest run of full prompt blocks found in the prefix cache.

        At least one prompt token is always left to compute: the forward over it yields the
        first output token's logits.
        """
        if not self.enable_prefix_caching:
            return []
        hits, h = [], -1
        for i in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(h, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence) -> None:
        """Start a new (or preempted) sequence's block table with its cached prefix blocks.

        Every cache (the target's and a drafter's that shares the block tables) holds these
        blocks' K/V: blocks are registered only once all of them do.
        """
        assert not seq.block_table
        # prompt logprobs need every prompt row computed: no prefix-cache hits for such a request (as vLLM)
        hits = self._cached_prefix(seq) if seq.params.prompt_logprobs is None else []
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_block_ids.remove(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_hashed_blocks = len(hits)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_drafter_blocks = next((i for i, b in enumerate(hits) if not self.blocks[b].drafter_valid), len(hits))
        seq.num_drafter_computed, seq.drafter_start = seq.num_drafter_blocks * self.block_size, 0

    def _run_start(self, length: int) -> int | None:
        """The oldest free block that starts a run of `length` free blocks (a new sequence's first block, so
        that its prompt and what follows fit in one run), or None."""
        blocks = self.blocks
        for b in self.free_block_ids:     # a check stops at the first block in use: usually the first b fits
            if b + length <= len(blocks) and all(blocks[i].ref_count == 0 for i in range(b + 1, b + length)):
                return b
        return None

    def can_ensure(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def ensure(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table to hold num_tokens slots."""
        need = self.num_blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise NoFreeBlocks(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            after = seq.block_table[-1] + 1 if seq.block_table else self._run_start(self.num_blocks_for(len(seq) + 1))
            seq.block_table.append(self._take_free_block(after))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the blocks past num_tokens slots (rejected draft tokens never need them again)."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, keep)
        seq.num_drafter_blocks = min(seq.num_drafter_blocks, keep)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = seq.num_drafter_blocks = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids.append(block_id)

    # ---- prefix caching ---------------------------------------------------------------------
    def register(self, seq: Sequence, num_valid_tokens: int, num_drafter_tokens: int) -> None:
        """Hash the full blocks among the first num_valid_tokens tokens (their K/V are in the target's cache), and
        mark those among the first num_drafter_tokens drafter-valid (the drafter's cache holds them too)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_valid_tokens // self.block_size, len(seq.block_table))
        h = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else -1
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(h, tokens)
            block.hash, block.token_ids = h, tokens
            self.hash_to_block.setdefault(h, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)
        for i in range(seq.num_drafter_blocks, min(num_drafter_tokens // self.block_size, seq.num_hashed_blocks)):
            block = self.blocks[seq.block_table[i]]
            block.drafter_valid = True
            holder = self.hash_to_block.get(block.hash)
            if holder is None or not self.blocks[holder].drafter_valid:
                self.hash_to_block[block.hash] = block.block_id
            seq.num_drafter_blocks = i + 1
