"""The acceptance side of "auto" (engine/draft_policy.py): decayed counts per draft position, the method's and every
sequence's."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRIOR_RUN_STEPS = 128           # the record's prior, one run this long (or as long as a sequence may still go)
RUN_DECAY = 0.95                # the runs' record decays by this per run ended


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
class Runs:
    """The steps sequences drafted in a row once chosen to (probes apart), decayed: what a catch-up is spread over.
    Spread over all the tokens a sequence may still generate (65536 for a request without max_tokens), a prompt's
    catch-up (~10 ms for EAGLE3 over 300 tokens of SmolLM2) looked free, however soon the sequence went back to 0.
    The prior, one run as long as the sequence may still go (at most PRIOR_RUN_STEPS), is optimistic on purpose: a
    record that expects short runs from the start keeps every catch-up dear, nothing drafts and no run corrects it
    (MTP at one sequence of sonnet, 1.09x at k=2, was held at 0 with an 8-step prior: its 540-token catch-up, 37 ms)."""
    count: float = 0.0
    steps: float = 0.0

    def end(self, steps: int) -> None:
        if steps > 0:
            self.count = self.count * RUN_DECAY + 1
            self.steps = self.steps * RUN_DECAY + steps

    @property
    def prior_weight(self) -> float:
        """The prior's weight, decayed as a run recorded first would be: RUN_DECAY ** runs, as count = sum of those."""
        return 1.0 - (1.0 - RUN_DECAY) * self.count

    def expected(self, remaining: np.ndarray) -> np.ndarray:
        """The steps sequences that may still generate `remaining` tokens are expected to go on drafting."""
        prior = np.minimum(remaining, PRIOR_RUN_STEPS)
        return np.clip((self.steps + self.prior_weight * prior) / (self.count + self.prior_weight), 1.0, remaining)


class SeqStats:
    """Every sequence's Acceptance, its steps held at 0, its probes in a row that landed nothing and its steps drafted
    in a row (chosen, not probes), as rows of arrays:
    a step's estimates are one gather (hot, a loop over the step's sequences was a quarter of the choice at 8)."""

    def __init__(self, positions: int):
        self.rows: dict[int, int] = {}              # seq_id -> its row
        self.free: list[int] = []
        self.attempted = self.accepted = np.zeros((0, positions))
        self.idle = self.failed = self.run = np.zeros(0, dtype=int)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.rows

    def row(self, seq_id: int) -> int:
        """The sequence's row; a new one starts at zero counts."""
        if (row := self.rows.get(seq_id)) is not None:
            return row
        if not self.free:
            n = len(self.idle)
            more = max(8, n)
            self.attempted, self.accepted = (np.concatenate([a, np.zeros((more, a.shape[1]))])
                                             for a in (self.attempted, self.accepted))
            self.idle, self.failed, self.run = (np.concatenate([a, np.zeros(more, dtype=int)])
                                                for a in (self.idle, self.failed, self.run))
            self.free = list(range(n + more - 1, n - 1, -1))
        row = self.rows[seq_id] = self.free.pop()
        self.attempted[row] = self.accepted[row] = self.idle[row] = self.failed[row] = self.run[row] = 0
        return row

    def forget(self, seq_id: int) -> int:
        """Free the sequence's row; returns its steps drafted in a row when it finished."""
        if (row := self.rows.pop(seq_id, None)) is None:
            return 0
        self.free.append(row)
        return int(self.run[row])

    def observe(self, row: int, num_drafted: int, num_accepted: int, decay: float) -> None:
        Acceptance(self.attempted[row], self.accepted[row]).observe(num_drafted, num_accepted, decay)    # views
        self.failed[row] = 0 if num_accepted else self.failed[row] + 1

    def advance_runs(self, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """A step's chosen lengths: each sequence's run goes on or ends; returns the lengths of those that ended."""
        run = self.run[rows]
        self.run[rows] = np.where(lengths > 0, run + 1, 0)
        return run[(lengths == 0) & (run > 0)]

    def decay(self, rows: np.ndarray, factor: float) -> None:
        self.attempted[rows] *= factor
        self.accepted[rows] *= factor
