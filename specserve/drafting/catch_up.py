"""What the drafters that keep their own cache beside the target's and defer their forwards over committed tokens
(EAGLE3's head, MTP's layers) share: where they restart, when they catch up, and over how many of the rows waiting."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.runtime.sequence import Sequence


def restart_tail(block_tails: torch.Tensor, seq: Sequence, block_size: int) -> torch.Tensor | None:
    """What a drafter that keeps per-block tails (block_tails [num_blocks, ...]: the state its next slot reads,
    stored at the last slot of every full block) reads when it restarts at seq.num_drafter_computed after the
    engine reset that count (a preemption, a prefix-cache hit): the tail of the cached prefix's last block.
    None at 0 (nothing to read) or mid-block (nothing was stored there)."""
    start = seq.num_drafter_computed
    if start == 0 or start % block_size:
        return None
    return block_tails[seq.block_table[start // block_size - 1]].clone()


def keep_block_tails(block_tails: torch.Tensor, seq: Sequence, first: int, rows: torch.Tensor, block_size: int) -> None:
    """Store, of rows (a drafter's states at slots first, first + 1, ...), those at the last slot of a block, in
    block_tails [num_blocks, ...]: what restart_tail reads."""
    for s in range(first + (-first - 1) % block_size, first + len(rows), block_size):
        block_tails[seq.block_table[s // block_size]] = rows[s - first]


# the committed tokens a deferring drafter holds per sequence before it runs over them anyway (1.2 MB of bf16
# states a sequence at width 576): below it, a prompt costs the drafter nothing until the sequence drafts
MAX_PENDING_TOKENS = 1024


def catch_up_now(seq: Sequence, num_pending: int, drafted: set[int]) -> bool:
    """A drafter that defers its forwards over committed tokens (EAGLE3's head, MTP's layers) runs them after a
    target forward for a sequence that drafted in it (it likely drafts the next step, from the root this
    computes) or holds MAX_PENDING_TOKENS; for any other sequence, at its next draft. A sequence "auto" holds at
    0 (a loaded server) never pays for the drafter over its prompt; its blocks enter the prefix cache
    target-only (engine/block_manager.py)."""
    return num_pending > 0 and (seq.seq_id in drafted or num_pending >= MAX_PENDING_TOKENS)


def backlog_skip(num_pending: int, window: int) -> int:
    """How many leading rows of a deferring drafter's backlog (num_pending committed rows it has not run over) its
    catch-up skips: all but the last `window` and the one before them, the restart's tail (what its first slot reads);
    none for window 0. It restarts there, its attention reading nothing before (seq.drafter_start), as past a
    target-only prefix-cache hit; its later drafts see the window and what follows. The drafter's context only
    shapes its drafts, never what verification accepts. The catch-up over a whole prompt cost ~27 ms for EAGLE3 over
    550 tokens of SmolLM2 (a step is ~25 ms), paid by every request that drafts and again after every hold; with a
    window of 64 its acceptance on sonnet and random prompts was unchanged (benchmarks/NOTES.md, session 31), as
    StreamingLLM-style drafts keep it in MagicDec and TriForce."""
    return max(0, num_pending - window - 1) if window else 0


def catch_up_rows(num_pending: int, window: int) -> int:
    """The rows a deferring drafter's catch-up runs over, of a backlog of num_pending (Proposer.catch_up_tokens)."""
    return num_pending - backlog_skip(num_pending, window)


def drop_rows(chunks: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """chunks (rows in order) without their first n rows."""
    out = []
    for chunk in chunks:
        if n < len(chunk):
            out.append(chunk[n:])
        n = max(0, n - len(chunk))
    return out


def timed(run, *args) -> float:
    """Seconds run(*args) takes."""
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def restart_at(seq: Sequence, first_row: int) -> int:
    """Where a deferring drafter with no state for a sequence restarts, the target's rows starting at first_row:
    at seq.num_drafter_computed (0, or a prefix-cache hit's drafter-valid blocks) when they start there, as a
    cache miss would. Otherwise (a hit on target-only blocks) at first_row, its own cache read from there on
    only (seq.drafter_start): its drafts see less context until it has more; verification keeps them exact."""
    if seq.num_drafter_computed != first_row:
        seq.num_drafter_computed = seq.drafter_start = first_row
    return first_row
