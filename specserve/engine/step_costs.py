"""The cost side of "auto" (engine/draft_policy.py): the target's forward-and-verify time T(R) over decode rows, the
time s a sequence's first row pays per cache slot it attends and s_chain each of its draft's verify rows, P per
prompt-chunk row, and the drafter's d per sequence's first draft token, c per draft token after it, r per token caught
up on and f per sequence that drafts (its forwards deferred past the step).

T is a table over row counts of one-slot rows, s the difference CALIBRATION_SLOTS-slot rows make and s_chain the
difference the same rows make as chains of CHAIN_CALIBRATION_ROWS, all measured at start-up (`calibrate`: the best of
CALIBRATION_ROUNDS interleaved rounds, T at every row count a draft at one sequence reaches and made non-decreasing; it
is no line over a few rows on a CPU: the weights' reads bound it, then the dot products, and SmolLM2's rows 2-6 cost 0.4
ms each where its 7th and 8th cost 5); T's table is scaled, by one factor that keeps its shape, after every decode-only
step toward its measured time less s * L + s_chain * L_d; P (the time per prompt-chunk row, from steps with prompt rows,
so that they do not skew T) a running mean of what such steps took beyond T and the slots' time; d, c and r a
least-squares fit of propose() times to its drafting sequences, their further draft tokens and its caught-up tokens over
recent steps (draft tokens alike until drafts of different lengths tell the first from the rest; draft and caught-up
tokens alike until a call without catch-up tells them apart: on draft tokens alone, a first call over a whole prompt
priced drafting out), r measured on its own where the drafter times its catch-up apart (EAGLE3, MTP); f a running
mean of the forwards a deferring drafter runs after a step (`on_target_forward`) per sequence that drafted in it (as a
per-token cost, it made every token after a sequence's first look as dear as the first)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TIME_RATE = 0.2                 # how far one measured step moves the cost table
# every row count a draft at one sequence can reach (1 + AUTO_MAX_DRAFT_TOKENS), then sparser: T is no line over a
# few rows (on SmolLM2 at one thread 16.4 / 18.2 / 19.8 / 18.2 / 18.3 / 19.6 / 23.6 / 29.2 ms at 1-8 rows, the
# weights' reads, then the CPU's dot products, bound it)
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 64, 128)
CALIBRATION_ROUNDS = 5
CALIBRATION_SLOTS = 512         # the context of the rows that measure s
SLOT_CALIBRATION_ROWS = 32     # enough rows that their slots' time stands out of the noise (at 8, s measured 0)
CHAIN_CALIBRATION_ROWS = 4      # and as chains of this many rows a sequence, s_chain


def warm_rate(count: int) -> float:
    """How far the count-th observation moves a running estimate: the plain mean at first, then TIME_RATE."""
    return max(TIME_RATE, 1 / count)


def running_mean(mean: float, count: int, x: float) -> tuple[float, int]:
    """A running estimate and its count of observations, after observing x (moved by warm_rate)."""
    count += 1
    return mean + warm_rate(count) * (x - mean), count


@dataclass(slots=True)
class StepCosts:
    """T(R) as a calibrated table over row counts (linear between points, beyond the last along its last slope) times
    a factor measured steps correct, s, s_chain, P, d, c, r, f."""
    rows: np.ndarray = field(default_factory=lambda: np.array(CALIBRATION_ROWS, dtype=float))
    seconds: np.ndarray | None = None   # T at each of `rows`, as calibrated
    scale: float = 1.0                  # what measured steps make of it
    per_row_slot: float = 0.0           # s: a decode row's time per slot it attends (each sequence's first row)
    per_chain_row_slot: float = 0.0     # s_chain: the same for the rows after it, its draft's (the context is hot)
    per_draft_token: float = 0.0        # c: each draft token after a sequence's first
    per_first_draft_token: float = 0.0  # d: a sequence's first draft token (the call's own overhead with it)
    per_catch_up_token: float = 0.0
    num_catch_up_samples: int = 0
    num_draft_samples: int = 0
    # decayed [x x^T | x * seconds] of propose() calls, x = (drafting sequences, draft tokens after each one's
    # first, caught-up tokens): d, c and r's fit
    drafter_moments: np.ndarray = field(default_factory=lambda: np.zeros((3, 4)))
    per_prompt_row: float = 0.0
    num_prompt_samples: int = 0
    per_drafting_seq: float = 0.0       # f
    num_deferred_samples: int = 0

    def calibrate(self, measure, max_slots: int = CALIBRATION_SLOTS) -> None:
        """measure(rows, slots, chain) -> seconds of one target forward and verify at that many rows, in sequences of
        `chain` rows each (a decode row and its draft's verify rows), a sequence's last row attending `slots` cache
        slots (at most max_slots: what the KV cache and context limit allow)."""
        slots, R, C = min(CALIBRATION_SLOTS, max_slots), SLOT_CALIBRATION_ROWS, CHAIN_CALIBRATION_ROWS
        chained = slots > C
        points = [(int(r), 1, 1) for r in self.rows] + ([(R, slots, 1)] if slots > 1 else []) \
            + ([(R, slots, C)] if chained else [])
        # the best of CALIBRATION_ROUNDS rounds over every point in turn: a row's cost at one to four rows is a few
        # percent of the step, under what a busy host moves one measurement (best of 2 in a row, T(2) - T(1) came out
        # 0 to 1.6 ms from one start-up to the next, and a verify row looked up to three times its cost)
        best = np.full(len(points), np.inf)
        for point in points:            # a first round warms up what a new process has not run yet, and is dropped
            measure(*point)
        for _ in range(CALIBRATION_ROUNDS):
            best = np.minimum(best, [measure(*point) for point in points])
        # non-decreasing: a point measured below the one before it (noise, or a kernel's shape: three rows cost more
        # than four on SmolLM2's bf16 kernel) does not make rows look free to add
        n = len(self.rows)
        self.seconds = np.maximum.accumulate(best[:n])
        if slots <= 1:
            return
        one_slot = float(np.interp(R, self.rows, self.seconds))
        self.per_row_slot = max(0.0, (best[n] - one_slot) / (R * (slots - 1)))
        if chained:     # R / C sequences: first rows at s, the C - 1 after each at s_chain (T holds a slot a row at s)
            first, after = chain_slots([(slots - C, C)] * (R // C))
            extra = best[n + 1] - one_slot - self.per_row_slot * (first - R)
            self.per_chain_row_slot = min(self.per_row_slot, max(0.0, extra / after))

    def target(self, rows: np.ndarray | float) -> np.ndarray:
        x, y = self.rows, self.seconds
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        r = np.asarray(rows, dtype=float)
        return self.scale * (np.interp(r, x, y) + slope * np.maximum(r - x[-1], 0.0))

    def attention(self, first_slots: float, chain_slots: float) -> float:
        """The slots' time: first_slots attended by sequences' first decode rows, chain_slots by the rows after them."""
        return self.per_row_slot * first_slots + self.per_chain_row_slot * chain_slots

    def observe_step(self, decode_rows: int, prompt_rows: int, seconds: float, decode_slots: int = 0,
                     chain_slots: int = 0) -> None:
        """A measured target forward and verify: a decode-only one corrects T, one with prompt rows P. decode_slots:
        the slots the sequences' first decode rows attend, chain_slots those the rows after them attend."""
        attention = self.attention(decode_slots, chain_slots)
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
        measured steps differ from the calibrated table by one factor, 1.2, from 32 rows to 100)."""
        if rows > 0 and seconds > 0:
            self.scale *= (seconds / float(self.target(rows))) ** TIME_RATE

    def observe_drafter(self, num_tokens: int, seconds: float, num_catch_up: int = 0, num_seqs: int = 1) -> None:
        """A propose() call's time, ~ d * num_seqs + c * (num_tokens - num_seqs) + r * num_catch_up: d, c and r
        refitted (non-negative) over the recent calls. A call's first draft token is dearer than the next ones for a
        draft model (its forward also takes the tokens accepted since the last call, and the call's own overhead:
        on SmolLM2 at one sequence 1.4 ms, then 0.8 ms a token) and cheaper for MTP (the first forward ran after
        the last step, in f: 0.7 ms, then 1.6). Fitted through the origin over all tokens alike, a second token
        looked as dear as the first for a draft model, and auto drafted one token where two were fastest. Until the
        calls tell the first token from the others (drafts of different lengths), tokens are priced alike: c and r
        fitted alone, r keeping its value while no recent call caught up on anything."""
        if num_tokens <= 0:
            return
        self.num_draft_samples += 1
        rate = warm_rate(self.num_draft_samples)
        num_seqs = max(1, min(num_seqs, num_tokens))
        x = np.array([num_seqs, num_tokens - num_seqs, num_catch_up], dtype=float)
        self.drafter_moments = (1 - rate) * self.drafter_moments + rate * np.outer(x, [*x, seconds])
        if not self.fit_first_token():
            self.fit_tokens_alike()

    def fit_first_token(self) -> bool:
        """d, c and r from the moments, where the calls determine them (drafts of more than one length; r only where
        a recent call caught up on something, else it keeps its value) and none comes out negative."""
        gram, y = self.drafter_moments[:, :3], self.drafter_moments[:, 3]
        terms = [0, 1, 2] if gram[2, 2] > 0 else [0, 1]
        gram, y = gram[np.ix_(terms, terms)], y[terms]
        diag = np.diag(gram)
        if (diag <= 0).any() or np.linalg.det(gram) <= 1e-3 * diag.prod():
            return False
        fit = np.linalg.solve(gram, y)
        if fit.min() < 0:
            return False
        self.per_first_draft_token, self.per_draft_token = fit[:2]
        if len(terms) == 3:
            self.per_catch_up_token = fit[2]
        return True

    def fit_tokens_alike(self) -> None:
        """c (= d) and r from the moments, every draft token priced alike: x = (draft tokens, caught-up tokens)."""
        m = self.drafter_moments
        a = m[0, 0] + 2 * m[0, 1] + m[1, 1]
        ab, b = m[0, 2] + m[1, 2], m[2, 2]
        y = (m[0, 3] + m[1, 3], m[2, 3])
        det = a * b - ab * ab
        c, r = ((y[0] * b - ab * y[1]) / det, (a * y[1] - ab * y[0]) / det) if det > 1e-6 * a * b else (-1.0, -1.0)
        if c >= 0 and r >= 0:
            self.per_draft_token, self.per_catch_up_token = c, r
        elif ab > 0 and self.per_catch_up_token == 0:   # every call caught up: price tokens of either kind alike
            self.per_draft_token = self.per_catch_up_token = (y[0] + y[1]) / (a + 2 * ab + b)
        else:           # no catch-up to separate (or a fit below 0 in one term): the other term takes all of it
            self.per_draft_token = max(0.0, y[0] - ab * self.per_catch_up_token) / a
        self.per_first_draft_token = self.per_draft_token

    def observe_deferred(self, num_seqs: int, seconds: float) -> None:
        """A step's deferred drafter forwards (Proposer.on_target_forward: the committed tokens of the num_seqs
        sequences that drafted, the first forward of their next draft): f, a running mean per such sequence."""
        if num_seqs <= 0:
            return
        self.per_drafting_seq, self.num_deferred_samples = running_mean(
            self.per_drafting_seq, self.num_deferred_samples, seconds / num_seqs)

    def observe_drafting(self, token_ids: list[list[int]], seconds: float, num_catch_up: int, deferred: float,
                         catch_up_seconds: float | None = None) -> None:
        """A step's drafter time: propose()'s `seconds` for its draft tokens and the num_catch_up tokens it caught up
        on (d, c, r), and the `deferred` seconds of forwards after the step for the sequences that drafted (f).
        catch_up_seconds: the part of `seconds` the drafter timed as its catch-up (Proposer.catch_up_seconds), r's
        own measure; fitted with the draft tokens instead, MTP's first call at 4 sonnet requests (3 sequences, 65
        tokens each to catch up on, one draft token each) put its time on d (4.1 ms against 2.1) and held the round."""
        num_seqs = sum(map(bool, token_ids))
        if catch_up_seconds is not None:
            self.observe_catch_up(num_catch_up, catch_up_seconds)
            seconds, num_catch_up = max(0.0, seconds - catch_up_seconds), 0
        self.observe_drafter(sum(map(len, token_ids)), seconds, num_catch_up, num_seqs)
        self.observe_deferred(num_seqs, deferred)

    def observe_catch_up(self, num_tokens: int, seconds: float) -> None:
        """A catch-up timed on its own: r, a running mean per token caught up on. A call over a few tokens also pays
        its forward's own overhead (~2 ms for MTP's layers), which this lays on its tokens: r read 0.68 ms after such
        calls against 0.08 over 65-token backlogs (benchmarks/NOTES.md, session 33; to be fitted per call and token)."""
        if num_tokens > 0:
            self.per_catch_up_token, self.num_catch_up_samples = running_mean(
                self.per_catch_up_token, self.num_catch_up_samples, seconds / num_tokens)


def row_slots(start: int, rows: int) -> int:
    """Cache slots `rows` decode-shaped rows from slot `start` attend in all (row r reads start + r + 1)."""
    return rows * start + rows * (rows + 1) // 2


def chain_slots(chains: list[tuple[int, int]]) -> tuple[int, int]:
    """Over (start, rows) sequences: the slots their first rows (from slot `start`) attend, and the rows after them."""
    first = sum(start + 1 for start, _ in chains)
    return first, sum(row_slots(start, rows) for start, rows in chains) - first
