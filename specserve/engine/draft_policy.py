"""Draft lengths chosen per step for `num_assistant_tokens: "auto"`: the batch's goodput, maximised.

The rule. For sequence i and draft position j (1-based) let a_ij be the probability that draft token j is accepted
given that tokens 1..j-1 were. Drafting k_i tokens, sequence i commits in expectation

    E_i(k_i) = 1 + sum_{j <= k_i} g_ij,      g_ij = prod_{m <= j} a_im

tokens (the accepted prefix, plus the target's own token after it). The step takes about

    S(k) = T(R) + s * L + s_chain * L_d + c * sum_i k_i + sum_{i: k_i > 0} (d - c + f + r * u_i / n_i),
                                                                                     R = decode rows (1 + k_i each)

where T is the target's forward-and-verify time at R decode rows, L the cache slots the sequences' first decode rows
attend (a row attends its whole context) and s the time such a row pays per slot, L_d the slots their drafts' verify
rows attend (draft token j of sequence i reads ctx_i + j) and s_chain what those pay per slot (less: they follow their
sequence's first row over the same context, in the CPU's caches; ~0.45 s on SmolLM2 at one thread), d the
drafter's time for a sequence's first draft token and c for each one after it, f its time per sequence that drafts
(EAGLE3's head and MTP's layers run over its committed tokens after the step, whatever the draft's length), and r its
time per token u_i it must catch up on before drafting for sequence i again (a drafter that skips sequences held at 0:
EAGLE3's head and MTP's layers over the target's states they hold, a draft model over the tokens it has not seen;
under load, a whole prompt), paid once, so spread over the n_i tokens the sequence may still generate. At a few
hundred slots a context, s * L is most of what a verify row costs on a CPU (each decode row is attended on its own, so
that its bits do not depend on its neighbours), and it grows with the batch's contexts, not with R alone. The
prompt-chunk rows a step may also carry are left out of S: their time is spent whatever is drafted, and counting it
would lower the step's ratio until every marginal draft token looked worth its verify row (under load most steps carry
a new request's prompt: at 32 concurrent 256-token requests auto drafted 2.8 tokens a sequence where plain decoding
was fastest). Maximising the ratio over the decode part is maximising E - lambda * S at the rate lambda decoding would
reach alone, the renewal-reward view of a long run of steps. The policy picks k maximising the goodput G(k) = sum_i
E_i(k_i) / S(k). Each g_ij falls with j, so adding draft tokens in descending order of g per cost over the whole batch
(a token's verify row, slots and draft, plus d - c + f + r * u_i / n_i spread over the sequence's cap) visits, for
every total n, about the allocation with the most expected tokens at that cost; G is evaluated exactly at every n at
once and the best n taken. Cheap verify rows and high acceptance give long chains; a large batch (T steep in R) with
low acceptance gives 0.

Estimates. a_ij blends the sequence's own decayed counts with a prior, the method's running per-position rate (itself
decayed, starting at PRIOR_ACCEPTANCE): a_ij = (acc_ij + W * A_j) / (att_ij + W). A sequence's counts decay by
SEQ_DECAY per draft verified and by IDLE_DECAY per step it is held at 0, so that a held sequence's estimate returns
toward the method's rate: on sonnet prompts, 4 of 6 EAGLE3 requests whose first 4-7 drafts were rejected sat at a_1 ~
0.22, the break-even, and stayed held for the rest of the request. T is a table over row counts of one-slot rows, s
the difference CALIBRATION_SLOTS-slot rows make and s_chain the difference the same rows make as chains of
CHAIN_CALIBRATION_ROWS, all measured at start-up (`calibrate`: the best of CALIBRATION_ROUNDS interleaved rounds, T at
every row count a draft at one sequence reaches and made non-decreasing; it is no line over a few rows on a CPU: the
weights' reads bound it, then the dot products, and SmolLM2's rows 2-6 cost 0.4 ms each where its 7th and 8th cost 5);
T's table is scaled, by one factor that keeps its shape, after every decode-only step toward its measured time less
s * L + s_chain * L_d; P (the time per prompt-chunk row, from steps with prompt rows, so that they do not skew T) a
running mean of what such steps took beyond T and the slots' time; d, c
and r a least-squares fit of propose() times to its drafting sequences, their further draft tokens and its caught-up
tokens over recent steps (draft tokens alike until drafts of different lengths tell the first from the rest; draft and
caught-up tokens alike until a call without catch-up tells them apart: on draft tokens alone, a first call over a
whole prompt priced drafting out); f a running mean of the forwards a deferring drafter runs after a step
(`on_target_forward`) per sequence that drafted in it (as a per-token cost, it made every token after a sequence's
first look as dear as the first). A sequence held at 0 drafts one token every PROBE_EVERY steps, so its estimate can
recover (the explore step of a bandit); each probe in a row that lands nothing doubles the wait, up to PROBE_EVERY <<
MAX_BACKOFF steps, because a probe is not free: a verify row over the whole context and a drafter forward, which at 32
sequences of text no drafter predicts made an idle drafter cost several percent of plain decoding's speed. So probes
are paid from a budget: EXPLORE_SHARE of the time the steps take (as the model prices them) accrues as credit, and a
due probe is made when the credit covers its cost (its catch-up r * u_i, its verify row, its draft token d, f).
Exploration then costs at most that share, at any load (a budget per probe that paid only the probe's verify row
stopped held EAGLE3 and MTP sequences from probing for good; one that ignored the catch-up cost the draft model 8% at
32 sequences of random text). The share itself follows what probes return: 2x the decayed rate at which a probe got
its sequence drafted the step after, capped at 1 and floored at MIN_EXPLORE_FRACTION: on text no drafter predicts,
every probe was lost, ~1.5% of the steps' time, and auto ran 0.98x of k=0 on its own server.

This follows the line of SpecDec++ (stop drafting where the predicted acceptance falls below what a token's verify
costs), SVIP (draft length from the draft's own acceptance estimate, per sequence and step), BanditSpec (draft lengths
learned online from measured rewards, with exploration) and SGLang's adaptive speculation (draft length per batch size
from measured step times). The choice only changes what is drafted, never what is accepted: output is exact whatever
lengths it picks."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve.engine.step_costs import (CALIBRATION_ROUNDS, CALIBRATION_SLOTS, CHAIN_CALIBRATION_ROWS,
                                          SLOT_CALIBRATION_ROWS, StepCosts, chain_slots)

PRIOR_ACCEPTANCE = 0.6          # per-position acceptance before anything is measured
PRIOR_WEIGHT = 4.0              # W: observations the method-wide rate counts as, in a sequence's estimate
SEQ_DECAY = 0.8                 # a sequence's counts decay by this per observation (recent text counts most)
IDLE_DECAY = 0.9                # and by this per step it is held at 0, back toward the method's rate
METHOD_DECAY = 0.995
PROBE_EVERY = 16
EXPLORE_SHARE = 0.02            # of the time steps take, what probes may spend
MAX_BACKOFF = 3                 # the wait between failed probes doubles at most this many times (16 -> 128 steps)
PROBE_YIELD_DECAY = 0.95        # the probes' record decays by this per probe
MIN_EXPLORE_FRACTION = 0.125    # of EXPLORE_SHARE, what probes that release nothing may still spend


@dataclass(slots=True)
class Acceptance:
    """Decayed counts per draft position: attempted (the position was verified) and accepted."""
    attempted: np.ndarray
    accepted: np.ndarray

    @classmethod
    def empty(cls, positions: int) -> Acceptance:
        return cls(np.zeros(positions), np.zeros(positions))

    def decay(self, factor: float) -> None:
        self.attempted *= factor
        self.accepted *= factor

    def observe(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        self.decay(decay)
        self.attempted[:min(num_accepted + 1, num_drafted)] += 1
        self.accepted[:num_accepted] += 1


@dataclass(slots=True)
class Candidate:
    """A decoding sequence the policy chooses for: its id, the most it may draft this step, the slots its last
    token's row attends (its draft token j attends context + j), and the tokens the drafter must catch up on
    before it drafts for it (Proposer.catch_up_tokens), spread over the `remaining` tokens it may still generate."""
    seq_id: int
    max_tokens: int
    context: int = 0
    catch_up: int = 0
    remaining: int = 1


class DraftPolicy:
    def __init__(self, max_positions: int):
        self.max_positions = max_positions
        self.method = Acceptance.empty(max_positions)
        self.seqs: dict[int, Acceptance] = {}
        self.idle_steps: dict[int, int] = {}
        self.failed_probes: dict[int, int] = {}     # drafts in a row that landed nothing, per sequence
        self.explore_credit = 0.0                   # seconds the next probes may cost
        self.probed: set[int] = set()               # the sequences probed in the last step
        self.probe_record = np.zeros(2)             # decayed: probes made, and those the next step drafted after
        self.costs = StepCosts()

    @property
    def calibrated(self) -> bool:
        return self.costs.seconds is not None

    def calibrate(self, measure, max_slots: int = CALIBRATION_SLOTS) -> None:
        """measure(rows, slots, chain) -> seconds of one target forward and verify at that many rows, in sequences of
        `chain` rows each (a decode row and its draft's verify rows), a sequence's last row attending `slots` cache
        slots (at most max_slots: what the KV cache and context limit allow)."""
        slots, R, C = min(CALIBRATION_SLOTS, max_slots), SLOT_CALIBRATION_ROWS, CHAIN_CALIBRATION_ROWS
        chained = slots > C
        points = [(int(r), 1, 1) for r in self.costs.rows] + ([(R, slots, 1)] if slots > 1 else []) \
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
        costs, n = self.costs, len(self.costs.rows)
        costs.seconds = np.maximum.accumulate(best[:n])
        if slots <= 1:
            return
        one_slot = float(np.interp(R, costs.rows, costs.seconds))
        costs.per_row_slot = max(0.0, (best[n] - one_slot) / (R * (slots - 1)))
        if chained:     # R / C sequences: first rows at s, the C - 1 after each at s_chain (T holds a slot a row at s)
            first, after = chain_slots([(slots - C, C)] * (R // C))
            extra = best[n + 1] - one_slot - costs.per_row_slot * (first - R)
            costs.per_chain_row_slot = min(costs.per_row_slot, max(0.0, extra / after))

    def acceptance(self, seq_id: int, prior: np.ndarray | None = None) -> np.ndarray:
        """a_ij for j = 1..max_positions (prior: the method's rate, self.prior(), where the caller has it)."""
        prior = self.prior() if prior is None else prior
        own = self.seqs.get(seq_id)
        if own is None:
            return prior
        return (own.accepted + PRIOR_WEIGHT * prior) / (own.attempted + PRIOR_WEIGHT)

    def prior(self) -> np.ndarray:
        m = self.method
        return (m.accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (m.attempted + PRIOR_WEIGHT)

    def choose(self, candidates: list[Candidate], fixed_rows: int, num_fixed_tokens: int, fixed_slots: int = 0,
               fixed_chain_slots: int = 0) -> list[int]:
        """Draft lengths for the candidates. fixed_rows: the step's decode rows the policy does not choose (1 per
        decoding sequence, fixed drafts), the first of each sequence attending fixed_slots slots in all and the
        fixed drafts' fixed_chain_slots; num_fixed_tokens: tokens the step commits regardless (one per sequence that
        samples)."""
        if not candidates:
            return []
        K = self.max_positions
        caps = np.array([min(c.max_tokens, K) for c in candidates])
        prior = self.prior()
        gains = np.cumprod(np.stack([self.acceptance(c.seq_id, prior) for c in candidates]), axis=1)   # [B, K]
        gains[np.arange(K)[None, :] >= caps[:, None]] = -1.0
        contexts = np.array([c.context for c in candidates], dtype=float)
        costs = self.costs
        target = costs.target(fixed_rows + np.arange(caps.sum() + 2))     # T at fixed_rows + n rows, n = 0 .. all
        catch_up = np.array([c.catch_up for c in candidates], dtype=float) * costs.per_catch_up_token
        # what drafting costs a sequence in a step beyond its tokens at c each: its share of the catch-up, f, and what
        # its first draft token costs beyond c (d - c)
        spread = catch_up / np.array([max(1, c.remaining) for c in candidates], dtype=float) + costs.per_drafting_seq \
            + (costs.per_first_draft_token - costs.per_draft_token)
        unit = float(target[1] - target[0]) + costs.per_draft_token \
            + costs.per_chain_row_slot * (contexts[:, None] + np.arange(1, K + 1)[None, :]) \
            + (spread / np.maximum(caps, 1))[:, None]
        order = np.argsort(-gains / np.maximum(unit, 1e-12), axis=None, kind="stable")
        sorted_gains = gains.reshape(-1)[order]
        usable = int((sorted_gains >= 0).sum())
        n = np.arange(usable + 1)
        expected = num_fixed_tokens + np.concatenate([[0.0], np.cumsum(sorted_gains[:usable])])
        # the slots each added draft token attends, in the order they are added: context + position
        added = contexts[order[:usable] // K] + order[:usable] % K + 1
        slots = np.concatenate([[0.0], np.cumsum(added)])
        first_tokens = np.where(order[:usable] % K == 0, spread[order[:usable] // K], 0.0)   # a sequence's first
        seconds = target[:usable + 1] + costs.attention(fixed_slots, fixed_chain_slots + slots) \
            + costs.per_draft_token * n \
            + np.concatenate([[0.0], np.cumsum(first_tokens)])
        best = int(np.argmax(expected / seconds))
        lengths = np.zeros(len(candidates), dtype=int)
        np.add.at(lengths, order[:best] // K, 1)
        # a probe's verify row: what one more row and its slots cost
        verify_row = float(target[best + 1] - target[best]) + costs.per_chain_row_slot * (contexts + 1)
        # explore: a sequence held at 0 probes one token now and then, paid from a budget of EXPLORE_SHARE of the steps'
        # time; what goes unspent is kept, up to what the longest wait between probes accrues
        self.record_probes(candidates, lengths)
        share = EXPLORE_SHARE * self.explore_fraction * float(seconds[best])
        self.explore_credit = min(self.explore_credit + share, share * (PROBE_EVERY << MAX_BACKOFF))
        probe_cost = catch_up + verify_row + costs.per_first_draft_token + costs.per_drafting_seq
        for i, c in enumerate(candidates):
            idle = self.idle_steps.get(c.seq_id, 0) + 1 if lengths[i] == 0 else 0
            if idle >= PROBE_EVERY << min(self.failed_probes.get(c.seq_id, 0), MAX_BACKOFF) and caps[i] > 0 \
                    and probe_cost[i] <= self.explore_credit:
                lengths[i], idle = 1, 0
                self.explore_credit -= probe_cost[i]
                self.probed.add(c.seq_id)
            if idle and (own := self.seqs.get(c.seq_id)) is not None:
                own.decay(IDLE_DECAY)
            self.idle_steps[c.seq_id] = idle
        return lengths.tolist()

    @property
    def explore_fraction(self) -> float:
        """What share of EXPLORE_SHARE probes may spend: 2x the (Laplace) rate at which a recent probe got its sequence
        drafted the step after it, at most 1 and at least MIN_EXPLORE_FRACTION."""
        made, released = self.probe_record
        return max(MIN_EXPLORE_FRACTION, min(1.0, 2 * (released + 1) / (made + 2)))

    def record_probes(self, candidates: list[Candidate], lengths: np.ndarray) -> None:
        """The last step's probes, each released or not by this step's choice (`lengths`) for its sequence."""
        for c, k in zip(candidates, lengths):
            if c.seq_id in self.probed:
                self.probe_record = self.probe_record * PROBE_YIELD_DECAY + (1.0, float(k > 0))
        self.probed = set()

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        own = self.seqs.get(seq_id)
        if own is None:
            own = self.seqs[seq_id] = Acceptance.empty(self.max_positions)
        own.observe(num_drafted, num_accepted, SEQ_DECAY)
        self.method.observe(num_drafted, num_accepted, METHOD_DECAY)
        self.failed_probes[seq_id] = 0 if num_accepted else self.failed_probes.get(seq_id, 0) + 1

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.idle_steps.pop(seq_id, None)
        self.failed_probes.pop(seq_id, None)


def choose_draft_lengths(policy: DraftPolicy, scheduled: list, catch_up=lambda seq: 0) -> None:
    """The "auto" sequences' num_draft_tokens in a step (engine/scheduler.py ScheduledSeq, each at its longest):
    the policy's choice for the whole step. The scheduler asks before it spends the step's token budget, so
    that the draft slots it does not choose go to prompt chunks. catch_up(seq): Proposer.catch_up_tokens."""
    auto = [s for s in scheduled if s.num_draft_tokens > 0 and s.seq.params.auto_draft]
    if auto:
        choose_auto(policy, scheduled, auto, catch_up)


def choose_auto(policy: DraftPolicy, scheduled: list, auto: list, catch_up) -> None:
    decoding = [s for s in scheduled if s.num_new == 1]
    fixed = [1 + (0 if s.seq.params.auto_draft else s.num_draft_tokens) for s in decoding]
    num_sampling = sum(s.completes_prompt for s in scheduled)
    remaining = lambda seq: 1 << 16 if seq.params.max_tokens is None else seq.params.max_tokens - seq.num_output_tokens
    lengths = policy.choose([Candidate(s.seq.seq_id, s.num_draft_tokens, s.seq.num_computed_tokens + 1, catch_up(s.seq),
                                       remaining(s.seq)) for s in auto], sum(fixed), num_sampling,
                          *chain_slots([(s.seq.num_computed_tokens, n) for s, n in zip(decoding, fixed)]))
    for s, k in zip(auto, lengths):
        s.num_draft_tokens = k


def observe_step_time(policy: DraftPolicy, scheduled: list, items: list, seconds: float) -> None:
    """A step's measured target forward and verify (its ForwardItems, in `scheduled` order), for the cost model."""
    if not policy.calibrated:
        return
    prompt_rows = sum(s.num_new for s in scheduled if s.num_new > 1)
    first, after = chain_slots([(it.start, len(it.token_ids)) for s, it in zip(scheduled, items) if s.num_new == 1])
    policy.costs.observe_step(sum(len(it.token_ids) for it in items) - prompt_rows, prompt_rows, seconds, first, after)
