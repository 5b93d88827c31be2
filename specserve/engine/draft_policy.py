"""Draft lengths chosen per step for `num_assistant_tokens: "auto"`: the batch's goodput, maximised.

The rule. For sequence i and draft position j (1-based) let a_ij be the probability that draft token j is accepted
given that tokens 1..j-1 were. Drafting k_i tokens, sequence i commits in expectation

    E_i(k_i) = 1 + sum_{j <= k_i} g_ij,      g_ij = prod_{m <= j} a_im

tokens (the accepted prefix, plus the target's own token after it). The step takes about

    S(k) = T(R) + s * L + s_chain * L_d + c * sum_i k_i + sum_{i: k_i > 0} (d + V_i) + [k > 0] (e + h * K),
                                                                    R = decode rows (1 + k_i each), K = max_i k_i

where T is the target's forward-and-verify time at R decode rows, L the cache slots the sequences' first decode rows
attend (a row attends its whole context) and s the time such a row pays per slot, L_d the slots their drafts' verify
rows attend (draft token j of sequence i reads ctx_i + j) and s_chain what those pay per slot (less: they follow their
sequence's first row over the same context, in the CPU's caches; each priced on R rows' threads), c the drafter's time
per draft token, d per sequence that drafts (with EAGLE3's head and MTP's layers run over its committed tokens after the
step, whatever the draft's length), h per draft step and e per step that drafts at all beyond them (a drafter forward's
own time, whatever the batch: MTP's layers took 1.5 ms for one sequence's draft token on SmolLM2, 2.2 ms for four), and
V_i the catch-up of the u_i tokens it must run over before drafting for sequence i again (EAGLE3's head and MTP's layers
over the last 64 target states they hold, drafting/catch_up.py; a draft model over the tokens it has not seen, under
load a whole prompt), U(u) = a + r * u, paid once and spread: V_i = U(v_i) / n_i + (U(u_i) - U(v_i)) / m_i, v_i =
min(u_i, PROBE_EVERY) what a run resumed after a hold pays again, n_i the steps it is expected to go on drafting (the
mean of recent runs of drafting steps in a row, at most the tokens it may still generate), m_i >= n_i the steps it is
expected to draft before its request ends (the share of recent steps drafted times those tokens: acceptance.py). Over
its runs alone (4 steps), a draft model's catch-up over a 545-token sonnet prompt held a sequence at 0 for its first 15
steps. At a few hundred slots a context, s * L is most of what a verify row costs on a CPU (each decode row is attended
on its own, so that its bits do not depend on its neighbours), and it grows with the batch's contexts, not with R alone.
The prompt-chunk rows a step may also carry are left out of S: their time is spent whatever is drafted, and counting it
would lower the step's ratio until every marginal draft token looked worth its verify row (under load most steps carry a
new request's prompt: at 32 concurrent 256-token requests auto drafted 2.8 tokens a sequence where plain decoding was
fastest). Maximising the ratio over the decode part is maximising E - lambda * S at the rate lambda decoding would reach
alone, the renewal-reward view of a long run of steps. The policy picks k maximising the goodput G(k) = sum_i E_i(k_i) /
S(k). Each g_ij falls with j, so adding draft tokens in descending order of g per cost over the whole batch (a token's
verify row, slots and c, plus d + V_i spread over the sequence's cap) visits, for every total n, about the allocation
with the most expected tokens at that cost; G is evaluated exactly at every n in one pass and the best n taken. Cheap
verify rows and high acceptance give long chains; a large batch (T steep in R) with low acceptance gives 0. The choice
is plain Python over lists of floats: over numpy arrays, each call cold after the target's forward, it added 0.34-0.37
ms to a step at one sequence of SmolLM2, against 0.05-0.07 ms (1.3% of a 28 ms step, against 0.2%).

Estimates. a_ij blends the sequence's own decayed counts with a prior, the method's running per-position rate (itself
decayed, starting at PRIOR_ACCEPTANCE): a_ij = (acc_ij + W_j * A_j) / (att_ij + W_j), W_j empirical Bayes's weight (4-64
observations), one draft's noise over how far the sequences' rates spread (acceptance.Dispersion). A sequence's counts
decay by SEQ_DECAY per draft verified and by IDLE_DECAY per step it is held at 0, so that a held sequence's estimate
returns toward the method's rate: on sonnet prompts, 4 of 6 EAGLE3 requests whose first 4-7 drafts were rejected sat at
a_1 ~ 0.22, the break-even, and stayed held for the rest of the request. The costs (T, s, s_chain, P, c, d, e, h, a, r)
are measured at start-up and corrected after every step: engine/step_costs.py. A sequence held at 0 drafts one token
every PROBE_EVERY steps, so its estimate can recover (the explore step of a bandit); each probe in a row that lands
nothing doubles the wait, up to PROBE_EVERY << MAX_BACKOFF steps, because a probe is not free: a verify row over the
whole context and a drafter forward, which at 32 sequences of text no drafter predicts made an idle drafter cost several
percent of plain decoding's speed. So probes are paid from a budget: EXPLORE_SHARE of the time the steps take (as the
model prices them) accrues as credit, and a due probe is made when the credit covers its cost (its catch-up U(u_i), its
verify row, c, d, and e if nothing else drafts). Exploration then costs at most that share, at any load (a budget per
probe that paid only the probe's verify row stopped held EAGLE3 and MTP sequences from probing for good; one that
ignored the catch-up cost the draft model 8% at 32 sequences of random text). The share itself follows what probes
return: 2x the decayed rate at which a probe got its sequence drafted the step after, capped at 1 and floored at
MIN_EXPLORE_FRACTION: on text no drafter predicts, every probe was lost, ~1.5% of the steps' time, and auto ran 0.98x of
k=0 on its own server. A choice holding the whole batch at 0 is kept for up to HOLD_STEPS steps unless a probe falls due
and is paid for: a held batch's estimates only drift, and choosing costs ~0.2 ms at 8 sequences of SmolLM2.

This follows the line of SpecDec++ (stop drafting where the predicted acceptance falls below what a token's verify
costs), SVIP (draft length from the draft's own acceptance estimate, per sequence and step), BanditSpec (draft lengths
learned online from measured rewards, with exploration) and SGLang's adaptive speculation (draft length per batch size
from measured step times). It changes what is drafted, never what is accepted: output is exact at any lengths."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, count
from operator import itemgetter, mul

from specserve.engine.acceptance import Acceptance, Dispersion, Runs, SeqStats
from specserve.engine.step_costs import CALIBRATION_SLOTS, StepCosts

PRIOR_ACCEPTANCE = 0.6          # per-position acceptance before anything is measured
PRIOR_WEIGHT = 4.0              # observations PRIOR_ACCEPTANCE counts as, in the method's rate
SEQ_DECAY = 0.8                 # a sequence's counts decay by this per observation (recent text counts most)
IDLE_DECAY = 0.9                # and by this per step it is held at 0, back toward the method's rate
METHOD_DECAY = 0.995
PROBE_EVERY = 16
EXPLORE_SHARE = 0.02            # of the time steps take, what probes may spend
MAX_BACKOFF = 3                 # the wait between failed probes doubles at most this many times (16 -> 128 steps)
PROBE_YIELD_DECAY = 0.95        # the probes' record decays by this per probe
MIN_EXPLORE_FRACTION = 0.125    # of EXPLORE_SHARE, what probes that release nothing may still spend
HOLD_STEPS = 4                  # a batch held at 0 whole keeps that choice for up to this many steps


@dataclass(slots=True)
class Candidate:
    """A decoding sequence the policy chooses for: its id, the most it may draft this step, the slots its last
    token's row attends (its draft token j attends context + j), and the tokens the drafter must catch up on
    before it drafts for it (Proposer.catch_up_tokens), and the `remaining` tokens it may still generate."""
    seq_id: int
    max_tokens: int
    context: int = 0
    catch_up: int = 0
    remaining: int = 1


@dataclass(slots=True)
class Hold:
    """A choice that held a whole batch at 0 (no probe), repeated for its sequences (`stats`): the step's priced time,
    each one's probe cost and steps to its next probe, and the steps repeated (their idle steps and decay pending)."""
    seq_ids: tuple
    stats: list
    seconds: float
    probe_costs: list
    due_in: list
    steps: int = 0


class DraftPolicy:
    def __init__(self, max_positions: int):
        self.max_positions = max_positions
        self.method, self.dispersion = Acceptance.empty(max_positions), Dispersion.empty(max_positions)
        self.seqs: dict[int, SeqStats] = {}
        self.explore_credit = 0.0                   # seconds the next probes may cost
        self.probed: set[int] = set()               # the sequences probed in the last step
        self.probe_record = (0.0, 0.0)              # decayed: probes made, and those the next step drafted after
        self.costs = StepCosts()
        self.hold: Hold | None = None
        self.runs = Runs()

    @property
    def calibrated(self) -> bool:
        return self.costs.seconds is not None

    def calibrate(self, measure, max_slots: int = CALIBRATION_SLOTS) -> None:
        self.costs.calibrate(measure, max_slots)

    def acceptance(self, seq_id: int) -> list[float]:
        """a_ij for j = 1..max_positions: the sequence's own counts blended with the method's rate."""
        prior = self.prior()
        return prior if (stats := self.seqs.get(seq_id)) is None else stats.rates(prior, self.dispersion.weights(prior))

    def prior(self) -> list[float]:
        return self.method.rates([PRIOR_ACCEPTANCE] * self.max_positions, PRIOR_WEIGHT)

    def stats(self, seq_id: int) -> SeqStats:
        """The sequence's record; a new one starts at zero counts."""
        if (stats := self.seqs.get(seq_id)) is None:
            stats = self.seqs[seq_id] = SeqStats.empty(self.max_positions)
        return stats

    def choose(self, candidates: list[Candidate], fixed_rows: int, num_fixed_tokens: int, fixed_slots: int = 0,
               fixed_chain_slots: int = 0) -> list[int]:
        """Draft lengths for the candidates. fixed_rows: the step's decode rows the policy does not choose (1 per
        decoding sequence, fixed drafts), the first of each sequence attending fixed_slots slots in all and the
        fixed drafts' fixed_chain_slots; num_fixed_tokens: tokens the step commits regardless (one per sequence that
        samples)."""
        if not candidates or self.repeat_hold(tuple(c.seq_id for c in candidates)):
            return [0] * len(candidates)
        return self.choose_afresh(candidates, fixed_rows, num_fixed_tokens, fixed_slots, fixed_chain_slots)

    def choose_afresh(self, candidates: list[Candidate], fixed_rows: int, num_fixed_tokens: int, fixed_slots: int = 0,
                      fixed_chain_slots: int = 0) -> list[int]:
        """choose(), whatever the hold."""
        self.end_hold()
        K, costs, prior = self.max_positions, self.costs, self.prior()
        stats, weights = [self.stats(c.seq_id) for c in candidates], self.dispersion.weights(prior)
        caps = [min(c.max_tokens, K) for c in candidates]
        scale, table = costs.scale, costs.unscaled(fixed_rows + sum(caps) + 2)     # T at fixed_rows + n rows
        row = scale * (table[fixed_rows + 1] - table[fixed_rows])          # a verify row
        per_slot = costs.slot_prices(fixed_rows + 1)[1]
        # a sequence's drafting beyond its tokens at c each: d, and its catch-up: what a run resumed after a hold pays
        # again shared by its expected run of steps, the rest (a prompt's, once) by the steps it is expected to draft
        remaining = [max(1, c.remaining) for c in candidates]
        catch_up, runs = [costs.catch_up(c.catch_up) for c in candidates], self.runs.expected(remaining)
        resumed = [costs.catch_up(min(c.catch_up, PROBE_EVERY)) for c in candidates]
        spread = [v / n + (u - v) / m + costs.per_draft_seq for u, v, n, m in
                  zip(catch_up, resumed, runs, self.runs.spans(remaining, runs))]
        # every draft token (sequence i, position j): its expected tokens g_ij per cost (its verify row, its slots,
        # c, and the sequence's spread over its cap), highest first (a sequence's in order, as g_ij falls with j), and
        # what it adds to the step's time beyond its row, its slots and the drafter's forwards (c, a first one spread)
        tokens, token_cost = [], costs.per_draft_token
        for i, (c, st, cap) in enumerate(zip(candidates, stats, caps)):
            if not cap:
                continue
            gains = accumulate(st.rates(prior, weights)[:cap], mul)
            share = max(row + spread[i] / cap, 1e-12) + token_cost
            tokens += [(g / (share + per_slot * slots), g, i, j, token_cost + (j == 0) * spread[i], slots)
                       for j, g, slots in zip(range(cap), gains, range(c.context + 1, c.context + cap + 1))]
        tokens.sort(key=itemgetter(0), reverse=True)        # stable: ties keep (i, j) order
        # the step's time and expected tokens with the first n of them, for every n: the best ratio wins (slots at
        # the price on the threads a forward of that many rows takes)
        time, chain, wide_at = 0.0, fixed_chain_slots, costs.wide_from - fixed_rows    # n from which it is wide
        s, s_chain = costs.slot_prices(fixed_rows)
        best, best_seconds = 0, scale * table[fixed_rows] + s * fixed_slots + s_chain * chain
        best_ratio = num_fixed_tokens / best_seconds
        gained, longest, forwards = float(num_fixed_tokens), 0, 0.0
        for n, (_, gain, i, j, cost, slots), target in zip(count(1), tokens, table[fixed_rows + 1:]):
            gained += gain
            time += cost
            chain += slots
            if n == wide_at:
                s, s_chain = costs.per_row_slot, costs.per_chain_row_slot
            if j >= longest:
                longest, forwards = j + 1, costs.forwards(j + 1)
            seconds = scale * target + time + forwards + s * fixed_slots + s_chain * chain
            if gained / seconds > best_ratio:
                best, best_seconds, best_ratio = n, seconds, gained / seconds
        lengths = [0] * len(candidates)
        for _, _, i, *_ in tokens[:best]:
            lengths[i] += 1
        verify_row = scale * (table[fixed_rows + best + 1] - table[fixed_rows + best])
        per_slot = costs.slot_prices(fixed_rows + best + 1)[1]
        self.explore(candidates, stats, lengths, caps, [u + verify_row + per_slot * (c.context + 1)
                                                        for c, u in zip(candidates, catch_up)], best_seconds)
        return lengths

    def explore(self, candidates: list[Candidate], stats: list[SeqStats], lengths: list[int], caps: list[int],
                probe_costs: list[float], step_seconds: float) -> None:
        """A sequence held at 0 probes one token now and then (lengths[i] = 1), paid from a budget of EXPLORE_SHARE of
        the steps' time; what goes unspent is kept, up to what the longest wait between probes accrues. probe_costs:
        each one's catch-up and verify row (one more row, and its slots); its drafting is added."""
        self.record_probes(candidates, lengths)
        self.runs.step(sum(k > 0 for k in lengths), len(lengths))
        for st, k in zip(stats, lengths):               # runs of steps drafted as chosen, before probes
            if k:
                st.run += 1
            elif st.run:
                self.runs.end(st.run)
                st.run = 0
        self.explore_credit = self.credit_after(step_seconds)
        drafting = self.costs.drafting([1], beside=any(lengths))
        probe_costs = [cost + drafting for cost in probe_costs]
        for i, (c, st) in enumerate(zip(candidates, stats)):
            st.idle = 0 if lengths[i] else st.idle + 1
            if not st.idle:
                continue
            if caps[i] > 0 and st.idle >= self.probe_wait(st) and probe_costs[i] <= self.explore_credit:
                lengths[i], st.idle = 1, 0
                self.explore_credit -= probe_costs[i]
                self.probed.add(c.seq_id)
            else:
                st.decay(IDLE_DECAY)                    # back toward the method's rate
        if not any(lengths):
            self.hold = Hold(tuple(c.seq_id for c in candidates), stats, step_seconds, probe_costs,
                             [self.probe_wait(st) - st.idle if cap > 0 else 1 << 30 for st, cap in zip(stats, caps)])

    @staticmethod
    def probe_wait(stats: SeqStats) -> int:
        """The idle steps before a held sequence probes: PROBE_EVERY, doubled per probe in a row that landed nothing."""
        return PROBE_EVERY << min(stats.failed, MAX_BACKOFF)

    def repeat_hold(self, seq_ids: tuple) -> bool:
        """Whether this step repeats the held choice: the same sequences, fewer than HOLD_STEPS steps since it was
        chosen, and no probe both due and paid for (its credit accrues as a chosen step's would). A held sequence's
        estimate only drifts (IDLE_DECAY) and its context grows a slot a step."""
        hold = self.hold
        if hold is None or hold.steps + 1 >= HOLD_STEPS or hold.seq_ids != seq_ids:
            return False
        credit = self.credit_after(hold.seconds)
        if any(due <= hold.steps + 1 and cost <= credit for due, cost in zip(hold.due_in, hold.probe_costs)):
            return False
        self.explore_credit = credit
        hold.steps += 1
        return True

    def end_hold(self) -> None:
        """Apply the repeated steps' idle steps and decay to the held sequences, and choose afresh from now on."""
        if (hold := self.hold) is not None and hold.steps:
            for st in hold.stats:
                st.idle += hold.steps
                st.decay(IDLE_DECAY ** hold.steps)
            self.runs.step(0, hold.steps * len(hold.stats))
        self.hold = None

    def credit_after(self, step_seconds: float) -> float:
        """The explore credit once a step of step_seconds has accrued its share (capped at the longest wait's)."""
        share = EXPLORE_SHARE * self.explore_fraction * step_seconds
        return min(self.explore_credit + share, share * (PROBE_EVERY << MAX_BACKOFF))

    @property
    def explore_fraction(self) -> float:
        """What share of EXPLORE_SHARE probes may spend: 2x the (Laplace) rate at which a recent probe got its sequence
        drafted the step after it, at most 1 and at least MIN_EXPLORE_FRACTION."""
        made, released = self.probe_record
        return max(MIN_EXPLORE_FRACTION, min(1.0, 2 * (released + 1) / (made + 2)))

    def record_probes(self, candidates: list[Candidate], lengths: list[int]) -> None:
        """The last step's probes, each released or not by this step's choice (`lengths`) for its sequence."""
        if self.probed:
            for c, k in zip(candidates, lengths):
                if c.seq_id in self.probed:
                    made, released = self.probe_record
                    self.probe_record = (made * PROBE_YIELD_DECAY + 1, released * PROBE_YIELD_DECAY + (k > 0))
            self.probed = set()

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.end_hold()
        self.dispersion.observe(stats := self.stats(seq_id), self.prior(), num_drafted, num_accepted)
        stats.observe(num_drafted, num_accepted, SEQ_DECAY)
        self.method.observe(num_drafted, num_accepted, METHOD_DECAY)

    def forget(self, seq_id: int) -> None:
        self.end_hold()
        if (stats := self.seqs.pop(seq_id, None)) is not None:
            self.runs.end(stats.run)
