"""Draft lengths chosen per step for `num_assistant_tokens: "auto"`: the batch's goodput, maximised.

The rule. For sequence i and draft position j (1-based) let a_ij be the probability that draft token j is
accepted given that tokens 1..j-1 were. Drafting k_i tokens, sequence i commits in expectation

    E_i(k_i) = 1 + sum_{j <= k_i} g_ij,      g_ij = prod_{m <= j} a_im

tokens (the accepted prefix, plus the target's own token after it). The step takes about

    S(k) = T(R) + P * prompt_rows + c * sum_i k_i,      R = decode-shaped rows (1 + k_i per decoding sequence,
                                                           plus fixed drafts)

where T is the target's forward-and-verify time at R decode rows, P its time per prompt-chunk row (batched
attention: far cheaper than a decode row) and c the drafter's time per draft token. The policy
picks k maximising the goodput G(k) = sum_i E_i(k_i) / S(k). Each g_ij falls with j, so adding draft tokens in
descending order of g over the whole batch visits, for every total n, the allocation with the most expected
tokens at that cost (S depends on n only); G is evaluated at every n at once and the best n taken. Cheap verify
rows and high acceptance give long chains; a large batch (T steep in R) with low acceptance gives 0.

Estimates. a_ij blends the sequence's own decayed counts with a prior, the method's running per-position rate
(itself decayed, starting at PRIOR_ACCEPTANCE): a_ij = (acc_ij + W * A_j) / (att_ij + W). T is a table over row
counts, measured at start-up (`calibrate`) and corrected after every decode-only step from its measured time;
P is a running mean of what steps with prompt rows took beyond T; c a running mean of propose() time per draft
token. A sequence held at 0 drafts one token every
PROBE_EVERY steps, so its estimate can recover (the explore step of a bandit).

This follows the line of SpecDec++ (stop drafting where the predicted acceptance falls below what a token's
verify costs), SVIP (draft length from the draft's own acceptance estimate, per sequence and step), BanditSpec
(draft lengths learned online from measured rewards, with exploration) and SGLang's adaptive speculation (draft
length per batch size from measured step times). The choice only changes what is drafted, never what is
accepted: output is exact whatever lengths it picks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PRIOR_ACCEPTANCE = 0.6          # per-position acceptance before anything is measured
PRIOR_WEIGHT = 4.0              # W: observations the method-wide rate counts as, in a sequence's estimate
SEQ_DECAY = 0.8                 # a sequence's counts decay by this per observation (recent text counts most)
METHOD_DECAY = 0.995
TIME_RATE = 0.2                 # how far one measured step moves the cost table
PROBE_EVERY = 16
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(slots=True)
class Acceptance:
    """Decayed counts per draft position: attempted (the position was verified) and accepted."""
    attempted: np.ndarray
    accepted: np.ndarray

    @classmethod
    def empty(cls, positions: int) -> Acceptance:
        return cls(np.zeros(positions), np.zeros(positions))

    def observe(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        self.attempted *= decay
        self.accepted *= decay
        self.attempted[:min(num_accepted + 1, num_drafted)] += 1
        self.accepted[:num_accepted] += 1


@dataclass(slots=True)
class StepCosts:
    """T(R) as a table over row counts (linear between points, beyond the last along its last slope), and c."""
    rows: np.ndarray = field(default_factory=lambda: np.array(CALIBRATION_ROWS, dtype=float))
    seconds: np.ndarray | None = None
    per_draft_token: float = 0.0
    num_draft_samples: int = 0
    per_prompt_row: float = 0.0
    num_prompt_samples: int = 0

    def target(self, rows: np.ndarray | float) -> np.ndarray:
        x, y = self.rows, self.seconds
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        r = np.asarray(rows, dtype=float)
        return np.where(r <= x[-1], np.interp(r, x, y), y[-1] + slope * (r - x[-1]))

    def observe_step(self, decode_rows: int, prompt_rows: int, seconds: float) -> None:
        """A measured target forward and verify: a decode-only one corrects T, one with prompt rows P."""
        if prompt_rows == 0:
            self.observe_target(decode_rows, seconds)
            return
        residual = max(0.0, seconds - (float(self.target(decode_rows)) if decode_rows else 0.0))
        self.num_prompt_samples += 1
        rate = max(TIME_RATE, 1 / self.num_prompt_samples)
        self.per_prompt_row += rate * (residual / prompt_rows - self.per_prompt_row)

    def observe_target(self, rows: int, seconds: float) -> None:
        """Move the points around `rows` toward the measured time (multiplicatively, weighted by closeness)."""
        if rows <= 0 or seconds <= 0:
            return
        ratio = seconds / float(self.target(rows))
        i = int(np.searchsorted(self.rows, rows))
        if i == 0 or i >= len(self.rows):
            weights = {min(i, len(self.rows) - 1): 1.0}
        else:
            lo, hi = self.rows[i - 1], self.rows[i]
            w = (rows - lo) / (hi - lo)
            weights = {i - 1: 1 - w, i: w}
        for j, w in weights.items():
            self.seconds[j] *= ratio ** (TIME_RATE * w)
        self.seconds = np.maximum.accumulate(self.seconds)     # more rows never cost less

    def observe_drafter(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0:
            return
        self.num_draft_samples += 1
        rate = max(TIME_RATE, 1 / self.num_draft_samples)
        self.per_draft_token += rate * (seconds / num_tokens - self.per_draft_token)


@dataclass(slots=True)
class DraftGauges:
    """Over recent decode steps (decayed): the mean draft length chosen per decoding sequence, and the
    fraction of decoding sequences that drafted."""
    mean_draft_length: float = 0.0
    drafting_fraction: float = 0.0

    def observe(self, lengths: list[int], rate: float = 0.2) -> None:
        if lengths:
            self.mean_draft_length += rate * (sum(lengths) / len(lengths) - self.mean_draft_length)
            self.drafting_fraction += rate * (sum(k > 0 for k in lengths) / len(lengths) - self.drafting_fraction)


@dataclass(slots=True)
class Candidate:
    """A decoding sequence the policy chooses for: its id, and the most it may draft this step."""
    seq_id: int
    max_tokens: int


class DraftPolicy:
    def __init__(self, max_positions: int):
        self.max_positions = max_positions
        self.method = Acceptance.empty(max_positions)
        self.seqs: dict[int, Acceptance] = {}
        self.idle_steps: dict[int, int] = {}
        self.costs = StepCosts()

    @property
    def calibrated(self) -> bool:
        return self.costs.seconds is not None

    def calibrate(self, measure) -> None:
        """measure(rows) -> seconds of one target forward and verify at that many rows."""
        times = [min(measure(int(r)) for _ in range(2)) for r in self.costs.rows]
        self.costs.seconds = np.maximum.accumulate(np.array(times, dtype=float))

    def acceptance(self, seq_id: int) -> np.ndarray:
        """a_ij for j = 1..max_positions."""
        m = self.method
        prior = (m.accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (m.attempted + PRIOR_WEIGHT)
        own = self.seqs.get(seq_id)
        if own is None:
            return prior
        return (own.accepted + PRIOR_WEIGHT * prior) / (own.attempted + PRIOR_WEIGHT)

    def choose(self, candidates: list[Candidate], fixed_rows: int, num_fixed_tokens: int, prompt_rows: int = 0
               ) -> list[int]:
        """Draft lengths for the candidates. fixed_rows: the step's decode rows the policy does not choose (1 per
        decoding sequence, fixed drafts); prompt_rows: its prompt-chunk rows; num_fixed_tokens: tokens the step
        commits regardless (one per sequence that samples)."""
        if not candidates:
            return []
        K = self.max_positions
        caps = np.array([min(c.max_tokens, K) for c in candidates])
        gains = np.cumprod(np.stack([self.acceptance(c.seq_id) for c in candidates]), axis=1)   # [B, K]
        gains[np.arange(K)[None, :] >= caps[:, None]] = -1.0
        order = np.argsort(-gains, axis=None, kind="stable")
        sorted_gains = gains.reshape(-1)[order]
        usable = int((sorted_gains >= 0).sum())
        n = np.arange(usable + 1)
        expected = num_fixed_tokens + np.concatenate([[0.0], np.cumsum(sorted_gains[:usable])])
        seconds = self.costs.target(fixed_rows + n) + self.costs.per_prompt_row * prompt_rows + \
            self.costs.per_draft_token * n
        best = int(np.argmax(expected / seconds))
        lengths = np.zeros(len(candidates), dtype=int)
        np.add.at(lengths, order[:best] // K, 1)
        for i, c in enumerate(candidates):      # explore: a sequence held at 0 probes one token now and then
            idle = self.idle_steps.get(c.seq_id, 0) + 1 if lengths[i] == 0 else 0
            if idle >= PROBE_EVERY and caps[i] > 0:
                lengths[i], idle = 1, 0
            self.idle_steps[c.seq_id] = idle
        return lengths.tolist()

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        own = self.seqs.get(seq_id)
        if own is None:
            own = self.seqs[seq_id] = Acceptance.empty(self.max_positions)
        own.observe(num_drafted, num_accepted, SEQ_DECAY)
        self.method.observe(num_drafted, num_accepted, METHOD_DECAY)

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.idle_steps.pop(seq_id, None)


def choose_draft_lengths(policy: DraftPolicy, scheduled: list) -> None:
    """The "auto" sequences' num_draft_tokens in a step (engine/scheduler.py ScheduledSeq; the scheduler reserved
    their longest): the policy's choice for the whole step."""
    auto = [s for s in scheduled if s.num_draft_tokens > 0 and s.seq.params.auto_draft]
    if not auto:
        return
    decoding = [s for s in scheduled if s.num_new == 1]
    fixed_rows = sum(1 + (0 if s.seq.params.auto_draft else s.num_draft_tokens) for s in decoding)
    prompt_rows = sum(s.num_new for s in scheduled if s.num_new > 1)
    num_sampling = sum(s.completes_prompt for s in scheduled)
    lengths = policy.choose([Candidate(s.seq.seq_id, s.num_draft_tokens) for s in auto], fixed_rows, num_sampling,
                            prompt_rows)
    for s, k in zip(auto, lengths):
        s.num_draft_tokens = k
