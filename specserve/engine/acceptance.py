"""The acceptance side of "auto" (engine/draft_policy.py): decayed counts per draft position, the method's and every
sequence's, as plain floats. The choice runs right after a forward has streamed the weights through the CPU's caches:
there every numpy call pays its own code's misses (~5-10 us each), and a choice over numpy arrays took 400 us at one
sequence of SmolLM2 where the same arithmetic on a few lists of floats takes 110."""
from __future__ import annotations

from dataclasses import dataclass

PRIOR_RUN_STEPS = 128           # the record's prior, one run this long (or as long as a sequence may still go)
RUN_DECAY = 0.95                # the runs' record decays by this per run ended
SHARE_DECAY = 0.99              # the share of steps drafted decays by this per step chosen
MIN_PRIOR_WEIGHT = 4.0          # W, the method's rate's weight in a sequence's estimate, at least (in observations)
MAX_PRIOR_WEIGHT = 64.0         # and at most
DISPERSION_DECAY = 0.995        # the spread's record decays by this per verified draft token
DISPERSION_SAMPLES = 32         # its (decayed) observations before W follows it


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

    def rates(self, prior: list[float], prior_weight: float | list[float]) -> list[float]:
        """Per position, the accepted share of the counts blended with `prior` counted as prior_weight observations
        (one for every position, or each its own)."""
        weights = [prior_weight] * len(prior) if isinstance(prior_weight, (int, float)) else prior_weight
        w = self.weight
        return [(acc * w + W * p) / (att * w + W)
                for att, acc, p, W in zip(self.attempted, self.accepted, prior, weights)]


@dataclass(slots=True)
class Dispersion:
    """How much a sequence's own record says about its next draft, per position: tau^2, the spread of the sequences'
    rates about the method's rate A, as the decayed mean of (x - A)(r - A) over verified draft tokens (x: accepted,
    r: the sequence's own rate before it, where it holds at least one observation; r's noise is independent of x, so
    only the spread is left). The empirical-Bayes weight of A in a sequence's estimate is then W = A(1 - A) / tau^2,
    one draft's noise over the spread, within [MIN_PRIOR_WEIGHT, MAX_PRIOR_WEIGHT]. Where the sequences do not differ
    a short record is noise: on sonnet prompts the draft model's first-token acceptance was 0.28 at every lag beyond
    the next draft (correlation 0.17 at lag 1, 0.01 at 2), tau^2 0.005 and W ~39, and at W = 4 auto held 20% of its
    steps after runs of rejections, where k=2 went on to commit 1.27 tokens a step, 6% faster than held."""
    products: list[float]
    counts: list[float]

    @classmethod
    def empty(cls, positions: int) -> Dispersion:
        return cls([0.0] * positions, [0.0] * positions)

    def observe(self, seq: Acceptance, prior: list[float], num_drafted: int, num_accepted: int) -> None:
        """Before `seq` records the draft's outcome."""
        for j in range(min(num_accepted + 1, num_drafted)):
            if seq.attempted[j] * seq.weight >= 1.0:
                spread = ((j < num_accepted) - prior[j]) * (seq.accepted[j] / seq.attempted[j] - prior[j])
                self.products[j] = self.products[j] * DISPERSION_DECAY + spread
                self.counts[j] = self.counts[j] * DISPERSION_DECAY + 1.0

    def weights(self, prior: list[float]) -> list[float]:
        """W per position, for Acceptance.rates (MIN_PRIOR_WEIGHT until the record has DISPERSION_SAMPLES)."""
        return [MIN_PRIOR_WEIGHT if n < DISPERSION_SAMPLES else
                min(MAX_PRIOR_WEIGHT, max(MIN_PRIOR_WEIGHT, a * (1.0 - a) * n / max(s, 1e-12)))
                for s, n, a in zip(self.products, self.counts, prior)]


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
