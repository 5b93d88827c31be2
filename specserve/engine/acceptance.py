"""The acceptance side of "auto" (engine/draft_policy.py): decayed counts per draft position, the method's and every
sequence's, as plain floats. The choice runs right after a forward has streamed the weights through the CPU's caches:
there every numpy call pays its own code's misses (~5-10 us each), and a choice over numpy arrays took 400 us at one
sequence of SmolLM2 where the same arithmetic on a few lists of floats takes 110."""
from __future__ import annotations

from dataclasses import dataclass

PRIOR_RUN_STEPS = 128           # the record's prior, one run this long (or as long as a sequence may still go)
RUN_DECAY = 0.95                # the runs' record decays by this per run ended
SHARE_DECAY = 0.99              # the share of steps drafted decays by this per step chosen


@dataclass(slots=True)
class Acceptance:
    """Decayed counts per draft position: attempted (the position was verified) and accepted, each times `weight`
    (a decay is one multiplication, folded into the counts when they next change)."""
    attempted: list[float]
    accepted: list[float]
    weight: float = 1.0

    @classmethod
    def empty(cls, positions: int) -> Acceptance:
        return cls([0.0] * positions, [0.0] * positions)

    def observe(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        w, verified = self.weight * decay, min(num_accepted + 1, num_drafted)
        self.attempted = [x * w + (j < verified) for j, x in enumerate(self.attempted)]
        self.accepted = [x * w + (j < num_accepted) for j, x in enumerate(self.accepted)]
        self.weight = 1.0

    def decay(self, factor: float) -> None:
        self.weight *= factor

    def rates(self, prior: list[float], prior_weight: float) -> list[float]:
        """Per position, the accepted share of the counts blended with `prior` counted as prior_weight observations."""
        w = self.weight
        return [(acc * w + prior_weight * p) / (att * w + prior_weight)
                for att, acc, p in zip(self.attempted, self.accepted, prior)]


@dataclass(slots=True)
class SeqStats(Acceptance):
    """A sequence's Acceptance, its steps held at 0, its probes in a row that landed nothing and its steps drafted in
    a row (chosen, not probes)."""
    idle: int = 0
    failed: int = 0
    run: int = 0

    def observe(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        Acceptance.observe(self, num_drafted, num_accepted, decay)
        self.failed = 0 if num_accepted else self.failed + 1


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
    drafted: float = 0.0        # decayed: the sequences' steps drafted as chosen (probes apart), and all their steps
    stepped: float = 0.0

    def step(self, drafted: int, sequences: int) -> None:
        self.drafted = self.drafted * SHARE_DECAY + drafted
        self.stepped = self.stepped * SHARE_DECAY + sequences

    def spans(self, remaining: list[int], runs: list[float]) -> list[float]:
        """The steps sequences that may still generate `remaining` tokens are expected to draft in all: the share of
        recent steps drafted (1 before any) times those tokens (at most PRIOR_RUN_STEPS), at least their `runs`."""
        share = self.drafted / self.stepped if self.stepped else 1.0
        return [max(n, share * min(r, PRIOR_RUN_STEPS)) for r, n in zip(remaining, runs)]

    def end(self, steps: int) -> None:
        if steps > 0:
            self.count = self.count * RUN_DECAY + 1
            self.steps = self.steps * RUN_DECAY + steps

    @property
    def prior_weight(self) -> float:
        """The prior's weight, decayed as a run recorded first would be: RUN_DECAY ** runs, as count = sum of those."""
        return 1.0 - (1.0 - RUN_DECAY) * self.count

    def expected(self, remaining: list[int]) -> list[float]:
        """The steps sequences that may still generate `remaining` tokens are expected to go on drafting."""
        weight = self.prior_weight
        return [min(max((self.steps + weight * min(r, PRIOR_RUN_STEPS)) / (self.count + weight), 1.0), r)
                for r in remaining]
