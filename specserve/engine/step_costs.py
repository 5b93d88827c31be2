"""The cost side of "auto" (engine/draft_policy.py): the target's forward-and-verify time T(R) over decode rows, the
time s a sequence's first row pays per cache slot it attends and s_chain each of its draft's verify rows, P per
prompt-chunk row, and the drafter's c per draft token, d per sequence that drafts, h per draft step (its longest
draft's tokens), e per step that drafts beyond that, and a per sequence and r per token it catches up on.

T is a table over row counts of one-slot rows, s the difference CALIBRATION_SLOTS-slot rows make and s_chain the
difference the same rows make as chains of CHAIN_CALIBRATION_ROWS (at SLOT_CALIBRATION_ROWS rows, and again under the
row count where forwards take more threads, for the steps there), all measured at start-up (`calibrate`: the best of
CALIBRATION_ROUNDS interleaved rounds, T at every row count a draft at one sequence reaches and made non-decreasing on
each side of the row count where forwards take more threads; it is no line over a few rows on a CPU: the weights' reads
bound it, then the dot products, and SmolLM2's rows 2-6 cost 0.4 ms each where its 7th and 8th cost 5); T's table is
scaled, by one factor that keeps its shape (and one more from where forwards take more threads), after every
decode-only step toward its measured time less s * L + s_chain * L_d; P (the time per prompt-chunk row, from steps
with prompt rows, so that they do not skew T) a running mean of what such steps took beyond T and the slots' time.

The drafter's prices are non-negative least-squares fits over recent steps (`LinearFit`): propose()'s time against the
tokens it caught up on, its draft steps, 1, its drafting sequences and its draft tokens (r, h, e, d, c);
the forwards a deferring drafter runs after a step (`on_target_forward`: EAGLE3's head, MTP's layers over the committed
tokens) against 1 and the sequences that drafted (e and d again); and where the drafter times its catch-up apart
(EAGLE3, MTP), that time against the sequences and the tokens caught up on, and 1 (a, r; the call's own time laid on
each sequence, as they mostly resume one at a time). A drafter's forward costs about the same for one sequence as for a
few (MTP's layers on SmolLM2: 1.5 ms for one sequence's draft token, 2.2 ms for four's; a catch-up over 2 tokens ~2 ms,
over 65 ~5 ms): priced per sequence and per token alone, drafting at 4 sequences looked 2.5x dearer than it was, and a
catch-up over a few tokens set r to 0.68 ms a token, against 0.08, which held every sequence 65 tokens behind. Terms the
recent steps do not tell apart (at one sequence e from d, and h from c; at one draft length h from e) are priced by the
first in that order, the others keeping the prices earlier steps fitted them (0 until some did), so that an unseen
batch is priced as the steps seen were, per forward: priced per sequence, a batch held at 0 would never draft to show
what it costs; and a catch-up, per sequence before per token."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from specserve.engine.running_fit import TIME_RATE, LinearFit, running_mean
from specserve.runtime.device import FORWARD_THREADS

logger = logging.getLogger(__name__)

# every row count a draft at one sequence can reach (1 + AUTO_MAX_DRAFT_TOKENS), then sparser: T is no line over a
# few rows (on SmolLM2 at one thread 16.4 / 18.2 / 19.8 / 18.2 / 18.3 / 19.6 / 23.6 / 29.2 ms at 1-8 rows, the
# weights' reads, then the CPU's dot products, bound it)
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 64, 128)
CALIBRATION_ROUNDS = 5
CALIBRATION_SLOTS = 512         # the context of the rows that measure s
SLOT_CALIBRATION_ROWS = 32     # enough rows that their slots' time stands out of the noise (at 8, s measured 0)
CHAIN_CALIBRATION_ROWS = 4      # and as chains of this many rows a sequence, s_chain


@dataclass(slots=True)
class StepCosts:
    """T(R) as a calibrated table over row counts (linear between points, beyond the last along its last slope) times
    a factor measured steps correct, s, s_chain, P, and the drafter's prices."""
    rows: np.ndarray = field(default_factory=lambda: np.array(CALIBRATION_ROWS, dtype=float))
    seconds: np.ndarray | None = None   # T at each of `rows`, as calibrated
    scale: float = 1.0                  # what measured steps make of it
    per_row_slot: float = 0.0           # s: a decode row's time per slot it attends (each sequence's first row)
    per_chain_row_slot: float = 0.0     # s_chain: the same for the rows after it, its draft's (the context is hot)
    narrow_row_slot: float = 0.0        # s and s_chain in steps under wide_from rows, on fewer threads
    narrow_chain_row_slot: float = 0.0
    per_prompt_row: float = 0.0
    num_prompt_samples: int = 0
    # the drafter's prices, from its fits (`refresh`)
    per_draft_call: float = 0.0         # e: a step that drafts at all
    per_draft_step: float = 0.0         # h: each draft step (the longest draft's tokens)
    per_draft_seq: float = 0.0          # d: each sequence that drafts
    per_draft_token: float = 0.0        # c: each draft token
    per_catch_up_seq: float = 0.0       # a: each sequence caught up on
    per_catch_up_token: float = 0.0     # r: each token caught up on
    # propose()'s seconds against (tokens caught up on, draft steps (the longest draft), 1, drafting sequences, draft
    # tokens); the deferred forwards' against (1, drafting sequences); a catch-up timed apart against (sequences,
    # tokens, 1)
    drafter_fit: LinearFit = field(default_factory=lambda: LinearFit.of(5))
    deferred_fit: LinearFit = field(default_factory=lambda: LinearFit.of(2))
    catch_up_fit: LinearFit = field(default_factory=lambda: LinearFit.of(3))
    table: list = field(default_factory=list)      # T unscaled at 0, 1, 2 ... rows, as plain floats (`unscaled`)
    table_of: np.ndarray | None = None              # the `seconds` it was made from
    wide_from: int = 0          # the rows from which forwards take more threads (0: none), where T drops
    wide_ratio: float = 1.0     # what measured steps make of T from there on, beyond `scale`
    table_ratio: float = 1.0    # the wide_ratio `table` was made with

    def calibrate(self, measure, max_slots: int = CALIBRATION_SLOTS, wide_from: int | None = None) -> None:
        """measure(rows, slots, chain) -> seconds of one target forward and verify at that many rows, in sequences of
        `chain` rows each (a decode row and its draft's verify rows), a sequence's last row attending `slots` cache
        slots (at most max_slots: what the KV cache and context limit allow). wide_from: the rows from which a
        forward takes more threads, where T drops (EAGLE3's server on SmolLM2: 45 ms at 15 rows on one thread, 29 at
        16 on two), measured on both sides; None: where this process's do (runtime/device.py, ForwardThreads), 0:
        nowhere."""
        wide_from = FORWARD_THREADS.wide_from if wide_from is None else wide_from
        if wide_from and wide_from > 1:
            self.rows = np.array(sorted({*self.rows.tolist(), wide_from - 1, wide_from}), dtype=float)
            self.wide_from = wide_from
        slots, R, C = min(CALIBRATION_SLOTS, max_slots), SLOT_CALIBRATION_ROWS, CHAIN_CALIBRATION_ROWS
        chained = slots > C
        narrow = (wide_from - 1) // C * C if wide_from and R >= wide_from else 0     # rows under it that measure s
        points = [(int(r), 1, 1) for r in self.rows] + [(rows, slots, chain) for rows in (R, narrow) if rows
                                                        and slots > 1 for chain in ((1, C) if chained else (1,))]
        # the best of CALIBRATION_ROUNDS rounds over every point in turn: a row's cost at one to four rows is a few
        # percent of the step, under what a busy host moves one measurement (best of 2 in a row, T(2) - T(1) came out
        # 0 to 1.6 ms from one start-up to the next, and a verify row looked up to three times its cost)
        best = np.full(len(points), np.inf)
        for point in points:            # a first round warms up what a new process has not run yet, and is dropped
            measure(*point)
        for _ in range(CALIBRATION_ROUNDS):
            best = np.minimum(best, [measure(*point) for point in points])
        # non-decreasing on each side of wide_from: a point measured below the one before it (noise, or a kernel's
        # shape: three rows cost more than four on SmolLM2's bf16 kernel) does not make rows look free to add
        n = len(self.rows)
        wide = int(np.searchsorted(self.rows, wide_from)) if wide_from else n
        self.seconds = np.concatenate([np.maximum.accumulate(best[:wide]), np.maximum.accumulate(best[wide:n])])
        logger.info("auto draft lengths: the target's step calibrated at %s", ", ".join(
            f"{r:g} rows {t * 1e3:.1f} ms" for r, t in zip(self.rows, self.seconds)))
        if slots <= 1:
            return
        measured = iter(best[n:])
        self.per_row_slot, self.per_chain_row_slot = self.slot_prices_at(R, slots, next(measured),
                                                                         next(measured) if chained else None)
        # under wide_from rows, on one thread of two, a slot cost SmolLM2 1.6-1.8 us against 1.0 at 32 rows on two,
        # and a chain's 0.8-0.9 against 0.3: priced at 32 rows, a draft's verify rows at one sequence looked 0.2 ms
        # (~1.5% of a step) cheaper each than they were
        self.narrow_row_slot, self.narrow_chain_row_slot = self.slot_prices_at(
            narrow, slots, next(measured), next(measured) if chained else None) if narrow else \
            (self.per_row_slot, self.per_chain_row_slot)

    def slot_prices_at(self, rows: int, slots: int, single: float, chained: float | None) -> tuple[float, float]:
        """s and s_chain from `rows` rows measured as single rows over `slots` slots each, and as chains of
        CHAIN_CALIBRATION_ROWS (None: not measured, s_chain 0), against T at that many one-slot rows."""
        one_slot, C = float(np.interp(rows, self.rows, self.seconds)), CHAIN_CALIBRATION_ROWS
        s = max(0.0, (single - one_slot) / (rows * (slots - 1)))
        if chained is None:
            return s, 0.0
        # rows / C sequences: first rows at s, the C - 1 after each at s_chain (T holds a slot a row at s)
        first, after = chain_slots([(slots - C, C)] * (rows // C))
        return s, min(s, max(0.0, (chained - one_slot - s * (first - rows)) / after))

    def slot_prices(self, rows: int) -> tuple[float, float]:
        """s and s_chain in a step of `rows` rows, on the threads its forward takes."""
        if rows < self.wide_from:
            return self.narrow_row_slot, self.narrow_chain_row_slot
        return self.per_row_slot, self.per_chain_row_slot

    def target(self, rows: np.ndarray | int) -> np.ndarray | float:
        if isinstance(rows, int):
            return self.scale * self.unscaled(rows + 1)[rows]
        return self.scale * self.interpolate(np.asarray(rows, dtype=float))

    def interpolate(self, rows: np.ndarray) -> np.ndarray:
        """The calibrated table at `rows`, linear between its points and beyond the last along its last slope, times
        wide_ratio from wide_from rows."""
        x, y = self.rows, self.seconds
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        seconds = np.interp(rows, x, y) + slope * np.maximum(rows - x[-1], 0.0)
        return seconds * np.where(rows >= self.wide_from, self.wide_ratio, 1.0) if self.wide_from else seconds

    def unscaled(self, rows: int) -> list[float]:
        """T before `scale` at 0 .. rows - 1 rows (at least), as plain floats: the policy's choice reads it a row
        count at a time (numpy's calls, cold after a forward, cost the choice more than its arithmetic)."""
        short = len(self.table) < rows          # grown by doubling; remade at its length when T or wide_ratio moved
        moved = abs(self.wide_ratio - self.table_ratio) > 0.01 * self.table_ratio
        if short or moved or self.table_of is not self.seconds:
            size = max(rows, 2 * len(self.table), 256) if short else len(self.table)
            self.table = self.interpolate(np.arange(size, dtype=float)).tolist()
            self.table_of, self.table_ratio = self.seconds, self.wide_ratio
        return self.table

    def attention(self, rows: int, first_slots: float, chain_slots: float) -> float:
        """The slots' time in a step of `rows` rows: first_slots attended by sequences' first decode rows,
        chain_slots by the rows after them."""
        s, s_chain = self.slot_prices(rows)
        return s * first_slots + s_chain * chain_slots

    def observe_step(self, decode_rows: int, prompt_rows: int, seconds: float, decode_slots: int = 0,
                     chain_slots: int = 0) -> None:
        """A measured target forward and verify: a decode-only one corrects T, one with prompt rows P. decode_slots:
        the slots the sequences' first decode rows attend, chain_slots those the rows after them attend."""
        attention = self.attention(decode_rows + prompt_rows, decode_slots, chain_slots)
        if prompt_rows == 0:
            # less the attention s accounts for; an overestimated s cannot drive the table below half of it at once
            self.observe_target(decode_rows, max(seconds - attention, 0.5 * float(self.target(decode_rows))))
            return
        residual = max(0.0, seconds - attention - (float(self.target(decode_rows)) if decode_rows else 0.0))
        self.per_prompt_row, self.num_prompt_samples = running_mean(self.per_prompt_row, self.num_prompt_samples,
                                                                    residual / prompt_rows)

    def observe_target(self, rows: int, seconds: float) -> None:
        """Scale the calibrated table toward a measured time: one factor for all rows (a geometric running mean), so
        that its shape holds. Moved point by point, steps at 33-64 rows raised T(32) more than T(64) and T(64) more
        than T(128): flat stretches where rows looked free to draft (on SmolLM2 at 32 sequences of 600 slots, the
        measured steps differ from the calibrated table by one factor, 1.2, from 32 rows to 100). Steps from
        wide_from rows, on more threads, correct that part on its own (wide_ratio): the server's front end stalls
        them as it cannot a one-thread step, which calibration at start-up does not see."""
        if rows > 0 and seconds > 0:
            factor = (seconds / float(self.target(rows))) ** TIME_RATE
            if self.wide_from and rows >= self.wide_from:
                self.wide_ratio *= factor
            else:
                self.scale *= factor

    def observe_drafting(self, token_ids: list[list[int]], seconds: float, catch_up: list[int], deferred: float,
                         catch_up_seconds: float | None = None) -> None:
        """A step's drafter time: propose()'s `seconds` for its draft tokens and the catch_up[i] tokens it caught up on
        for each sequence that asked for a draft, and the `deferred` seconds of forwards after the step for those
        that drafted. catch_up_seconds: the part of `seconds` the drafter timed as its catch-up
        (Proposer.catch_up_seconds), fitted on its own: with the draft tokens, MTP's first call at 4 sonnet requests
        (3 sequences, 65 tokens each to catch up on, one draft token each) priced drafting at 4.1 ms a sequence
        against 2.1 and held the round."""
        lengths = [len(ids) for ids in token_ids if ids]
        caught = [u for u in catch_up if u > 0]
        if catch_up_seconds is not None:
            if caught:
                self.catch_up_fit.observe((len(caught), sum(caught), 1), catch_up_seconds)
            seconds, caught = max(0.0, seconds - catch_up_seconds), []
        if lengths:
            self.drafter_fit.observe((sum(caught), max(lengths), 1, len(lengths), sum(lengths)), seconds)
            self.deferred_fit.observe((1, len(lengths)), deferred)
        self.refresh()

    def refresh(self) -> None:
        """The policy's prices, from the three fits."""
        (r, self.per_draft_step, call, per_seq, self.per_draft_token), deferred = self.drafter_fit.coef, \
            self.deferred_fit.coef
        self.per_draft_call, self.per_draft_seq = call + deferred[0], per_seq + deferred[1]
        if self.catch_up_fit.count:     # its call's own time laid on each sequence caught up (they resume one by one)
            per_seq, r, call = self.catch_up_fit.coef
            self.per_catch_up_seq = per_seq + call
        self.per_catch_up_token = r

    def drafting(self, lengths: list[int], catch_up: list[int] | None = None, beside: bool = False) -> float:
        """The drafter's time, as priced, for a step drafting lengths[i] tokens for sequence i, which must first catch
        up on catch_up[i] tokens; beside: drafts already in the step pay for its forwards (e, h)."""
        drafting = [(k, u) for k, u in zip(lengths, catch_up or [0] * len(lengths)) if k > 0]
        if not drafting:
            return 0.0
        forwards = 0.0 if beside else self.forwards(max(k for k, _ in drafting))
        return forwards + sum(self.per_draft_seq + self.per_draft_token * k + self.catch_up(u) for k, u in drafting)

    def forwards(self, steps):
        """e + h * steps: the drafter forwards' own time in a step whose longest draft is `steps` (an array too)."""
        return self.per_draft_call + self.per_draft_step * steps

    def catch_up(self, tokens):
        """a + r * tokens where tokens > 0, else 0: a sequence's catch-up over `tokens` (an array too)."""
        return (tokens > 0) * self.per_catch_up_seq + self.per_catch_up_token * tokens


def row_slots(start: int, rows: int) -> int:
    """Cache slots `rows` decode-shaped rows from slot `start` attend in all (row r reads start + r + 1)."""
    return rows * start + rows * (rows + 1) // 2


def chain_slots(chains: list[tuple[int, int]]) -> tuple[int, int]:
    """Over (start, rows) sequences: the slots their first rows (from slot `start`) attend, and the rows after them."""
    first = sum(start + 1 for start, _ in chains)
    return first, sum(row_slots(start, rows) for start, rows in chains) - first
