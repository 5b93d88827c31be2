"""Continuous batching: decoding sequences first, then prompt chunks in the remaining token budget.

A scheduled sequence computes `num_new` of its uncomputed tokens (token_ids[num_computed:]); a
decoding sequence has exactly one (the last sampled token) and may add `num_draft_tokens` draft slots.
When the cache runs out, the most recently admitted sequence is preempted (its blocks freed, to
be recomputed, mostly from the prefix cache, when memory frees up).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specserve.engine.block_manager import BlockManager
from specserve.runtime.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int          # uncomputed tokens fed this step
    num_draft_tokens: int  # draft slots reserved (decoding sequences only)

    @property
    def completes_prompt(self) -> bool:
        """True when this step reaches the last token, so the forward yields logits to sample from."""
        return self.seq.num_computed_tokens + self.num_new == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_draft_tokens_of, choose=None) -> list[ScheduledSeq]:
        """num_draft_tokens_of(seq) -> the most draft slots a decoding sequence may take this step. choose(decoding):
        sets the step's draft lengths of the decoding sequences (ScheduledSeq, at those maxima) before any budget
        is spent, so that slots a draft policy does not use go to prompt chunks (the engine's "auto")."""
        bm, budget = self.block_manager, self.max_num_batched_tokens
        decoding = [ScheduledSeq(seq, 1, num_draft_tokens_of(seq)) for seq in self.running
                    if len(seq) - seq.num_computed_tokens == 1]
        if choose is not None and decoding:
            choose(decoding)
        wants = {s.seq.seq_id: s.num_draft_tokens for s in decoding}
        scheduled: list[ScheduledSeq] = []
        # running sequences, oldest first; preempt from the newest end when blocks run out
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            uncomputed = len(seq) - seq.num_computed_tokens
            # draft slots count against the step's token budget, so drafts never grow a batch past it
            num_draft_tokens = min(wants[seq.seq_id], max(0, budget - 1)) if uncomputed == 1 else 0
            num_new = min(uncomputed, budget - num_draft_tokens) if uncomputed > 1 else 1
            if num_new <= 0:
                i += 1
                continue
            need = seq.num_computed_tokens + num_new + num_draft_tokens
            while not bm.can_ensure(seq, need) and self.running[-1] is not seq:
                self.preempt(self.running.pop())
            if not bm.can_ensure(seq, need):
                if num_draft_tokens and bm.can_ensure(seq, need - num_draft_tokens):
                    need, num_draft_tokens = need - num_draft_tokens, 0
                else:
                    self.running.pop()
                    self.preempt(seq)
                    break
            bm.ensure(seq, need)
            scheduled.append(ScheduledSeq(seq, num_new, num_draft_tokens))
            budget -= num_new + num_draft_tokens
            i += 1
        # admit waiting sequences while blocks, sequence slots and token budget allow
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            bm.allocate(seq)
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            if not bm.can_ensure(seq, seq.num_computed_tokens + num_new):
                bm.free(seq)
                seq.num_computed_tokens = seq.num_drafter_computed = 0
                break
            self.waiting.popleft()
            bm.ensure(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new, 0))
            budget -= num_new
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_drafter_computed = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
