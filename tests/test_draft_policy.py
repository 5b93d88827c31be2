"""num_assistant_tokens "auto": the policy's choices on synthetic costs, and exactness whatever it chooses."""
import time

import numpy as np
import pytest

from specserve.config import demo_model_dir
from specserve.engine import draft_policy
from specserve.engine.acceptance import RUN_DECAY
from specserve.engine.draft_policy import (EXPLORE_SHARE, MAX_BACKOFF, MIN_EXPLORE_FRACTION, PROBE_EVERY, Candidate,
                                          DraftPolicy)
from specserve.engine.step_costs import StepCosts
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

DEMO = demo_model_dir()
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "The capital of France is"]


def target_measure(rows_to_seconds, per_row_slot: float = 0.0, per_chain_row_slot: float | None = None):
    """A fake LLMEngine.time_forward: rows_to_seconds(R), plus per_row_slot for every slot a sequence's first row
    attends and per_chain_row_slot (default: the same) for every slot the rows after it attend."""
    chain_rate = per_row_slot if per_chain_row_slot is None else per_chain_row_slot

    def measure(rows: int, slots: int, chain: int = 1) -> float:
        seqs, start = rows // chain, slots - chain          # row r of a sequence attends start + r + 1 slots
        after = sum(start + r + 1 for r in range(1, chain))
        return rows_to_seconds(rows) + seqs * (per_row_slot * (start + 1) + chain_rate * after)
    return measure


def policy_with(rows_to_seconds, acceptance: dict[int, float], per_row_slot: float = 0.0,
                per_chain_row_slot: float | None = None) -> DraftPolicy:
    """A policy whose target costs rows_to_seconds(R) plus per_row_slot for every slot a sequence's first row
    attends (per_chain_row_slot for the rows after it), and whose sequences have learned `acceptance`."""
    policy = DraftPolicy(8)
    policy.calibrate(target_measure(rows_to_seconds, per_row_slot, per_chain_row_slot))
    assert policy.costs.per_row_slot == pytest.approx(per_row_slot, abs=1e-12)
    chain_rate = per_row_slot if per_chain_row_slot is None else per_chain_row_slot
    assert policy.costs.per_chain_row_slot == pytest.approx(chain_rate, abs=1e-12)
    teach(policy, acceptance)
    return policy


def teach(policy: DraftPolicy, acceptance: dict[int, float]) -> None:
    """The policy's sequences learn `acceptance`: 200 drafts of 8 whose tokens are each accepted at that rate."""
    for seq_id, rate in acceptance.items():
        rng = np.random.default_rng(seq_id)
        for _ in range(200):
            accepted = 0
            while accepted < 8 and rng.random() < rate:
                accepted += 1
            policy.observe(seq_id, 8, accepted)


def test_long_drafts_when_verify_is_cheap_and_acceptance_high():
    policy = policy_with(lambda rows: 0.010 + 0.0001 * rows, {1: 0.9, 2: 0.9})
    assert policy.choose([Candidate(1, 8), Candidate(2, 8)], fixed_rows=2, num_fixed_tokens=2) == [8, 8]
    assert policy.choose([Candidate(1, 3)], fixed_rows=1, num_fixed_tokens=1) == [3]      # never past the cap


def test_nothing_when_the_batch_is_large_and_acceptance_low():
    # 32 sequences; every verify row costs as much as a tenth of a step: drafting at 10% acceptance never pays
    seqs = {i: 0.1 for i in range(32)}
    policy = policy_with(lambda rows: 0.005 + 0.001 * rows, seqs)
    assert policy.choose([Candidate(i, 8) for i in seqs], fixed_rows=32, num_fixed_tokens=32) == [0] * 32


def test_each_sequence_by_its_own_acceptance():
    policy = policy_with(lambda rows: 0.010 + 0.0005 * rows, {1: 0.95, 2: 0.05})
    long, short = policy.choose([Candidate(1, 8), Candidate(2, 8)], fixed_rows=2, num_fixed_tokens=2)
    assert long >= 4 and short == 0


def test_rows_that_attend_long_contexts_draft_less():
    """On a CPU a verify row's attention over its context is most of what it costs: the same batch and acceptance
    draft long at 50 slots a sequence and nothing at 4,000 (SmolLM2 at 2 threads: ~2 us a row per slot)."""
    policy = policy_with(lambda rows: 0.015 + 0.0002 * rows, {i: 0.6 for i in range(16)}, per_row_slot=2e-6)
    short = policy.choose([Candidate(i, 8, 50) for i in range(16)], fixed_rows=16, num_fixed_tokens=16,
                          fixed_slots=16 * 50)
    long = policy.choose([Candidate(i, 8, 4000) for i in range(16)], fixed_rows=16, num_fixed_tokens=16,
                         fixed_slots=16 * 4000)
    assert sum(short) >= 16 and sum(long) == 0
    costs = policy.costs       # a decode step's measured time less its attention corrects the one-slot table
    before = costs.target(32)
    costs.observe_step(decode_rows=32, prompt_rows=0, seconds=float(before) + 2e-6 * 32 * 4000, decode_slots=32 * 4000)
    assert costs.target(32) == pytest.approx(before)


def test_a_prompt_chunk_in_the_step_does_not_buy_longer_drafts():
    """Its time is spent whatever is drafted: counted in the step's time, it would make marginal draft tokens look
    cheap against the step (under load most steps carry a new request's prompt)."""
    from types import SimpleNamespace
    from specserve.engine.auto_draft import choose_draft_lengths

    def step(with_prompt: bool) -> list[int]:
        policy = policy_with(lambda rows: 0.02 + 0.001 * rows, {i: 0.5 for i in range(8)}, per_row_slot=2e-6)
        policy.costs.per_prompt_row = 0.002                       # a 256-row chunk: 0.5 s, 25 decode steps' worth
        params = SimpleNamespace(auto_draft=True, max_tokens=None)
        decoding = [SimpleNamespace(seq=SimpleNamespace(seq_id=i, params=params, num_computed_tokens=300,
                                                        num_output_tokens=5), num_new=1,
                                    num_draft_tokens=8, completes_prompt=True) for i in range(8)]
        prompt = SimpleNamespace(seq=SimpleNamespace(seq_id=99, params=params, num_computed_tokens=0, num_output_tokens=0),
                                 num_new=256,
                                 num_draft_tokens=0, completes_prompt=False)
        choose_draft_lengths(policy, decoding + [prompt] * with_prompt)
        return [s.num_draft_tokens for s in decoding]
    assert step(with_prompt=True) == step(with_prompt=False)


def test_a_sequence_held_at_zero_probes_now_and_then():
    policy = policy_with(lambda rows: 0.010 + 0.002 * rows, {1: 0.0})     # 200 drafts that landed nothing
    n = 2 * (PROBE_EVERY << MAX_BACKOFF)
    choices = [policy.choose([Candidate(1, 8)], fixed_rows=1, num_fixed_tokens=1)[0] for _ in range(n)]
    assert choices.count(1) == 2 and set(choices) == {0, 1}


def test_failed_probes_back_off_and_a_landed_one_resets():
    policy = policy_with(lambda rows: 0.010 + 0.003 * rows, {1: 0.0})     # sequence 2 is new, held at 0 by the prior
    probes = []
    for step in range(16 + 32 + 64 + 128 + 128):
        if policy.choose([Candidate(2, 8)], fixed_rows=1, num_fixed_tokens=1)[0]:
            probes.append(step)
            policy.observe(2, 1, 0)                                   # nothing accepted
    assert probes[0] == PROBE_EVERY - 1 and np.diff(probes).tolist() == [32, 64, 128, 128]   # doubling, up to 128
    policy.observe(2, 1, 1)                                           # a probe that lands: back to every 16
    choices = [policy.choose([Candidate(2, 8)], fixed_rows=1, num_fixed_tokens=1)[0] for _ in range(16)]
    assert choices.count(1) == 1


def test_a_drafter_far_behind_a_sequence_costs_its_catch_up():
    """EAGLE3's head (MTP's layers, a draft model) runs over everything it skipped before it drafts again: under
    load that is a whole prompt, so the first draft token of such a sequence pays it."""
    policy = policy_with(lambda rows: 0.010 + 0.0005 * rows, {i: 0.6 for i in range(4)})
    for _ in range(10):        # 5 draft tokens, 0.2 ms each; a catch-up of 256 tokens, 40 us each, now and then
        policy.costs.observe_drafting([[0] * 5], 0.001, [0], 0.0)
        policy.costs.observe_drafting([[0]], 0.0002 + 256 * 40e-6, [256], 0.0)
    assert policy.costs.drafting([5]) == pytest.approx(1e-3) and policy.costs.per_catch_up_token == pytest.approx(40e-6)
    caught_up, behind = policy.choose([Candidate(1, 8), Candidate(2, 8, catch_up=256)], fixed_rows=2, num_fixed_tokens=2)
    assert caught_up > 0 and behind == 0
    # paid once: spread over the 200 tokens it may still generate, it no longer holds the sequence at 0
    assert policy.choose([Candidate(2, 8, catch_up=256, remaining=200)], fixed_rows=1, num_fixed_tokens=1)[0] > 0


def test_a_catch_up_is_spread_over_the_steps_sequences_go_on_drafting():
    """A catch-up is paid once, for the steps the sequence then drafts in a row. Spread over every token it may still
    generate (65536 without max_tokens), it looked free however soon the sequence went back to 0 (a prompt's
    catch-up is ~10 ms for EAGLE3 over 300 tokens of SmolLM2, a quarter of a step at 8 sequences). But what a run
    resumed after a short hold does not pay again (a draft model's catch-up over a whole prompt: after it, a hold of
    4 steps costs a catch-up over 4 tokens) is spread over the steps the sequence is expected to draft before its
    request ends: over runs of 4 steps alone, a 545-token sonnet prompt held a draft model's sequences at 0 for their
    first 15 steps."""
    def behind_drafts(runs: list[int], share: float) -> int:
        policy = policy_with(lambda rows: 0.010 + 0.001 * rows, {1: 0.4})
        policy.costs.per_draft_token, policy.costs.per_catch_up_token = 2e-4, 40e-6
        for steps in runs:
            policy.runs.end(steps)
        policy.runs.step(round(1000 * share), 1000)
        return policy.choose([Candidate(1, 8, catch_up=1024, remaining=1 << 16)], fixed_rows=1, num_fixed_tokens=1)[0]
    assert behind_drafts([60] * 20, share=0.02) > 0
    assert behind_drafts([1] * 20, share=0.02) == 0     # back to 0 after a step, and held nearly always
    assert behind_drafts([1] * 20, share=0.5) > 0       # back to 0 after a step, but drafting every other step

    # the record: runs of steps drafted as chosen, ended by a step held at 0 or by the sequence finishing
    policy = policy_with(lambda rows: 0.010 + 0.003 * rows, {1: 0.9, 2: 0.9})
    before = policy.runs.count, policy.runs.steps
    for _ in range(3):
        assert all(policy.choose([Candidate(1, 8), Candidate(2, 8)], fixed_rows=2, num_fixed_tokens=2))
    for _ in range(30):
        policy.observe(1, 8, 0)
    held, drafting = policy.choose([Candidate(1, 8), Candidate(2, 8)], fixed_rows=2, num_fixed_tokens=2)
    assert held == 0 and drafting > 0
    assert (policy.runs.count, policy.runs.steps) == pytest.approx((before[0] * RUN_DECAY + 1, before[1] * RUN_DECAY + 3))
    policy.forget(2)
    assert (policy.runs.count, policy.runs.steps) == pytest.approx(
        (before[0] * RUN_DECAY ** 2 + RUN_DECAY + 1, before[1] * RUN_DECAY ** 2 + 3 * RUN_DECAY + 4))


def test_a_held_sequence_returns_toward_the_method_rate_and_drafts_again():
    """A sequence whose first drafts were rejected is held at 0; while held, its own counts decay toward the method's
    rate, so that text which turns predictable is drafted again before a probe would have been due."""
    policy = policy_with(lambda rows: 0.010 + 0.006 * rows, {i: 0.8 for i in range(1, 5)})    # the method: 0.8
    for _ in range(20):
        policy.observe(9, 3, 0)                                      # sequence 9 starts badly
    held = policy.acceptance(9)[0]
    assert held < 0.4
    choices = [policy.choose([Candidate(9, 8)], fixed_rows=1, num_fixed_tokens=1)[0] for _ in range(PROBE_EVERY)]
    resumed = next(i for i, k in enumerate(choices) if k > 0)
    assert choices[0] == 0 and resumed < PROBE_EVERY - 1 and all(choices[resumed:])
    assert policy.acceptance(9)[0] > held + 0.02


def test_probes_cost_at_most_their_share_of_the_time_at_any_load():
    """Probes are paid from a budget of EXPLORE_SHARE of the steps' time. At one sequence a held EAGLE3 or MTP
    sequence, whose catch-up grows by a token a step, still probes every PROBE_EVERY steps (against one verify row
    it stopped after 16); at 32 sequences, each a whole prompt behind, the probes stay within the share (each probe
    paid for its own catch-up, they cost the draft model 8% of plain decoding at 32 sequences of random text)."""
    def run(num_seqs: int, catch_up, steps: int) -> tuple[list[int], float, float]:
        policy = policy_with(lambda rows: 0.010 + 0.001 * rows, {}, per_row_slot=1e-6)
        policy.method.attempted = [1e6] * 8          # a method that lands nothing: all held
        policy.costs.per_catch_up_token, policy.costs.per_draft_token = 40e-6, 2e-4
        probes, spent, total = [0] * num_seqs, 0.0, 0.0
        for step in range(steps):
            cands = [Candidate(i, 8, context=300, catch_up=catch_up(step), remaining=500) for i in range(num_seqs)]
            lengths = policy.choose(cands, fixed_rows=num_seqs, num_fixed_tokens=num_seqs)
            total += float(policy.costs.target(num_seqs))
            for i, k in enumerate(lengths):
                probes[i] += k
                spent += k * (catch_up(step) * 40e-6 + 0.001 + 1e-6 * 301 + 2e-4)
        return probes, spent, total
    probes, _, _ = run(1, lambda step: step % PROBE_EVERY + 1, 4 * PROBE_EVERY)
    assert probes == [4]
    probes, spent, total = run(32, lambda step: 300, 200)
    assert sum(probes) > 0 and spent <= EXPLORE_SHARE * total * 1.05 and min(probes) < 2


def test_probes_that_release_nothing_spend_a_smaller_share_and_one_that_does_restores_it():
    """On text no drafter predicts every probe is lost (~1.5% of the steps' time: auto ran 0.98x of k=0 on its own
    server). The share probes may spend follows the rate at which a probe got its sequence drafted the step after."""
    policy = policy_with(lambda rows: 0.010 + 0.0002 * rows, {})
    policy.method.attempted = [1e6] * 8          # a method that lands nothing: all held
    def run(steps: int, accept: int, first_id: int = 0) -> tuple[float, float, int]:
        spent = total = released = 0.0
        for step in range(steps):
            cands = [Candidate(first_id + i, 8, context=300, remaining=500) for i in range(16)]
            lengths = policy.choose(cands, fixed_rows=16, num_fixed_tokens=16)
            total += float(policy.costs.target(16))
            for c, k in zip(cands, lengths):
                if k:
                    spent += float(policy.costs.target(17) - policy.costs.target(16))
                    released += c.seq_id not in policy.probed                # drafted, not probed
                    for _ in range(8 if accept else 1):
                        policy.observe(c.seq_id, 1, accept)
        return spent, total, int(released)
    run(400, accept=0)                                                    # the record fills with lost probes
    assert policy.explore_fraction == MIN_EXPLORE_FRACTION
    spent, total, _ = run(800, accept=0)
    assert 0 < spent <= MIN_EXPLORE_FRACTION * EXPLORE_SHARE * total * 1.1
    _, _, released = run(400, accept=1, first_id=100)                     # text turns predictable: probes release
    assert released > 0 and policy.explore_fraction == 1.0


def test_a_batch_held_whole_repeats_its_choice_with_the_same_probes_and_decay(monkeypatch):
    """A choice that holds every sequence at 0 is repeated without choosing again for up to HOLD_STEPS steps (choosing
    cost ~1% of a step at 8 sequences of SmolLM2): the probes fall on the same steps, and the sequences' idle steps
    and decayed counts come out as if every step had been chosen. A new sequence ends the hold at once."""
    hold_steps = draft_policy.HOLD_STEPS

    def run(steps_held: int):
        monkeypatch.setattr(draft_policy, "HOLD_STEPS", steps_held)
        policy = policy_with(lambda rows: 0.010 + 0.001 * rows, {}, per_row_slot=1e-6)
        policy.method.attempted = [1e6] * 8          # a method that lands nothing: all held
        for i in range(8):
            policy.observe(i, 4, 1)
        afresh, chosen = policy.choose_afresh, []
        policy.choose_afresh = lambda *args: chosen.append(step) or afresh(*args)
        log = []
        for step in range(300):
            cands = [Candidate(i, 8, context=300, remaining=500) for i in range(8 + (step >= 250))]
            log.append(policy.choose(cands, fixed_rows=len(cands), num_fixed_tokens=len(cands)))
            for c, k in zip(cands, log[-1]):
                policy.observe(c.seq_id, k, 0)
        policy.end_hold()
        return log, chosen, policy
    every, chosen_every, reference = run(1)
    held, chosen, policy = run(hold_steps)
    assert held == every and 0 < sum(map(sum, held)) < 40              # the same probes, on the same steps
    assert chosen_every == list(range(300)) and len(chosen) < 300 / (hold_steps - 1) and 250 in chosen
    for i in range(9):
        assert policy.seqs[i].idle == reference.seqs[i].idle
        held, every = ([x * p.seqs[i].weight for x in p.seqs[i].attempted] for p in (policy, reference))
        assert held == pytest.approx(every, rel=1e-9, abs=1e-12)
    assert policy.explore_credit == pytest.approx(reference.explore_credit, rel=1e-9)


def test_a_cost_per_drafting_sequence_buys_longer_drafts_than_the_same_cost_per_token():
    """f, paid once a step by a sequence that drafts (a deferring drafter's forward over its committed tokens), is
    spread over its draft: where it would hold a sequence to a short draft as a per-token cost, it buys a longer
    one; far above what any draft returns, it holds the sequence at 0."""
    per_token, per_seq, held = (policy_with(lambda rows: 0.020 + 0.0005 * rows, {i: 0.8 for i in range(8)})
                                for _ in range(3))
    per_token.costs.per_draft_token = 0.006
    per_seq.costs.per_draft_seq = 0.006
    held.costs.per_draft_seq = 1.0
    short = per_token.choose([Candidate(1, 8)], fixed_rows=1, num_fixed_tokens=1)[0]
    longer = per_seq.choose([Candidate(1, 8)], fixed_rows=1, num_fixed_tokens=1)[0]
    assert 0 < short < longer
    assert held.choose([Candidate(1, 8)], fixed_rows=1, num_fixed_tokens=1) == [0]
    costs = StepCosts()
    costs.observe_drafting([[5, 6], [], [7]], 0.004, [0, 0, 0], deferred=0.010)
    assert costs.drafting([2, 0, 1]) == pytest.approx(0.014)


def test_a_drafters_forward_is_priced_per_forward_not_per_sequence():
    """A drafter forward costs about the same for one sequence as for a few: MTP's layers on the default model took
    1.5 / 4.2 / 7.8 ms to draft 1 / 2 / 4 tokens for one sequence and 2.2 / 6.4 / 12.9 ms for four (with ~1.0 and
    1.6 ms of forwards after the step). Priced per sequence and token, drafting at 4 sequences looked 2.5x dearer
    than it was, and at an acceptance of 0.5 the batch was held where one token each pays."""
    per_forward, per_seq = (policy_with(lambda rows: 0.016 + 0.0005 * rows, {i: 0.5 for i in range(4)})
                            for _ in range(2))
    costs = per_forward.costs
    for k in (1, 2, 4) * 3:
        costs.observe_drafting([[0] * k], {1: 1.5e-3, 2: 4.16e-3, 4: 7.84e-3}[k], [0], 1.0e-3)
    assert costs.drafting([4]) == pytest.approx(8.84e-3, rel=0.1)
    assert costs.drafting([1] * 4) == pytest.approx(costs.drafting([1]))      # an unseen batch: as one forward
    for k in (1, 2, 4) * 3:
        costs.observe_drafting([[0] * k] * 4, {1: 2.17e-3, 2: 6.43e-3, 4: 12.86e-3}[k], [0] * 4, 1.6e-3)
    # a line through shapes that are not one (MTP's first draft step is cheap: its forward ran after the last step)
    assert costs.drafting([1] * 4) == pytest.approx(3.77e-3, rel=0.35)
    assert costs.drafting([2] * 4) == pytest.approx(8.03e-3, rel=0.1)
    assert costs.drafting([4] * 4) == pytest.approx(14.46e-3, rel=0.1)
    assert costs.drafting([1] * 4) < 2 * costs.drafting([1])
    per_seq.costs.per_draft_seq = costs.drafting([1])
    batch = [Candidate(i, 8) for i in range(4)]
    assert all(per_forward.choose(batch, fixed_rows=4, num_fixed_tokens=4))
    assert per_seq.choose(batch, fixed_rows=4, num_fixed_tokens=4) == [0] * 4


def test_a_catch_up_timed_apart_is_priced_per_sequence_and_per_token():
    """A catch-up the drafter timed apart is fitted on its own, against the sequences and the tokens caught up on:
    3 sequences 65 tokens behind took 15.6 ms, and one sequence 2 tokens behind (resuming after a step held) 2 ms.
    As a mean per token, the small ones priced the 65-token backlog at 65 ms and held every sequence behind it."""
    costs = StepCosts()
    for _ in range(10):
        costs.observe_drafting([[5, 6]], 0.004, [0], deferred=0.0, catch_up_seconds=0.0)
    costs.observe_drafting([[5], [6], [7]], 0.006 + 15.6e-3, [65] * 3, deferred=0.0, catch_up_seconds=15.6e-3)
    assert costs.catch_up_fit.count == 1
    assert costs.drafting([1], [65]) - costs.drafting([1]) == pytest.approx(5.2e-3)
    assert costs.drafting([2]) == pytest.approx(0.004) and costs.drafting([1] * 3) == pytest.approx(0.006)
    for _ in range(5):
        costs.observe_drafting([[5, 6]], 0.004 + 2e-3, [2], deferred=0.0, catch_up_seconds=2e-3)
    assert costs.drafting([1], [2]) - costs.drafting([1]) == pytest.approx(2e-3, rel=0.01)
    assert costs.drafting([1], [65]) - costs.drafting([1]) == pytest.approx(5.2e-3, rel=0.01)


def test_a_first_call_over_a_whole_prompt_does_not_price_the_draft_tokens():
    """The first propose() of a request drafts 2 tokens and catches up on its 1,000-token prompt: with nothing yet
    to separate the two costs, a token of either kind is priced alike (laid on the 2 draft tokens, the prompt made
    a draft token cost 50 ms and held every sequence at 0). Calls without catch-up then separate them."""
    policy = policy_with(lambda rows: 0.010 + 0.0005 * rows, {i: 0.6 for i in range(4)})
    policy.costs.observe_drafting([[0, 0]], 2 * 1e-3 + 1000 * 20e-6, [1000], 0.0)
    assert policy.costs.drafting([2]) < 1e-4
    assert policy.choose([Candidate(1, 8)], fixed_rows=1, num_fixed_tokens=1)[0] > 0
    for _ in range(10):
        policy.costs.observe_drafting([[0, 0]], 2 * 1e-3, [0], 0.0)
    assert policy.costs.drafting([2]) == pytest.approx(2e-3, rel=0.05)
    assert policy.costs.per_catch_up_token == pytest.approx(20e-6, rel=0.05)


def test_a_first_draft_token_dearer_than_the_next_buys_longer_drafts():
    """A draft model's call pays its overhead and the tokens accepted since the last call with its first draft token
    (on the default model at one sequence: 1.4 ms, then 0.8 ms a token). Once calls of different lengths tell the two
    apart, d and c are fitted apart, and a second token is priced at c: fitted alike through the origin, every token
    cost ~1.5 ms and auto drafted one where two were fastest."""
    policy = policy_with(lambda rows: 0.016 + 0.0006 * rows, {})
    costs = policy.costs
    for _ in range(3):                             # drafts of one length: the first token and the next priced alike
        costs.observe_drafting([[0, 0]], 2.2e-3, [0], 0.0)
    assert costs.drafting([1]) == pytest.approx(1.1e-3) and costs.drafting([2]) == pytest.approx(2.2e-3)
    for k in (1, 2, 3, 1, 2, 3):                    # without catch-up (MTP's drafts, kept up after every step)
        costs.observe_drafting([[0] * k], 1.4e-3 + 0.8e-3 * (k - 1), [0], 0.0)
    assert costs.drafting([1]) == pytest.approx(1.4e-3) and costs.drafting([3]) == pytest.approx(3.0e-3)
    for k in (1, 2, 3, 1, 2, 3):
        costs.observe_drafting([[0] * k], 1.4e-3 + 0.8e-3 * (k - 1) + 30e-6 * k, [k], 0.0)
    assert costs.drafting([1]) == pytest.approx(1.4e-3, rel=0.01)
    assert costs.drafting([3]) == pytest.approx(3.0e-3, rel=0.01)
    assert costs.per_catch_up_token == pytest.approx(30e-6, rel=0.01)
    # acceptance 0.3, then 0.45 given the first, then 0.2 (sonnet at one sequence): two tokens pay at these prices
    policy.method.attempted, policy.method.accepted = [1e6] * 8, [0.3e6, 0.45e6] + [0.2e6] * 6
    assert policy.choose([Candidate(1, 8)], fixed_rows=1, num_fixed_tokens=1) == [2]
    costs.per_draft_call = costs.per_draft_step = 0.0                  # the calls fitted alike through the origin
    costs.per_draft_token = 1.46e-3
    assert policy.choose([Candidate(1, 8)], fixed_rows=1, num_fixed_tokens=1) == [1]


def test_a_split_fitted_once_outlives_steps_of_one_draft_length():
    """Once calls of several lengths have told a call's overhead e from a draft step h, steps that all draft one length
    (a draft model at one sequence, drafting one token a step) keep that split: e keeps its price and h takes the rest.
    Left at 0, e went to h: a draft step priced 2.9 ms (the whole call) where it cost 0.7 ms, and auto drafted one token
    where four were faster. With no split ever fitted, the first term takes it all, as before."""
    policy = policy_with(lambda rows: 0.016 + 0.0006 * rows, {})
    costs = policy.costs
    for k in (1, 2, 3, 4, 1, 2, 3, 4):
        costs.observe_drafting([[0] * k], 1.9e-3 + 0.7e-3 * k, [0], 0.0)
    assert (costs.per_draft_call, costs.per_draft_step) == (pytest.approx(1.9e-3), pytest.approx(0.7e-3))
    for _ in range(40):                             # one token a step, its call dearer than it was
        costs.observe_drafting([[0]], 2.8e-3, [0], 0.0)
    assert costs.drafting([1]) == pytest.approx(2.8e-3, rel=1e-3)
    assert costs.per_draft_call > 1.5e-3 and costs.per_draft_step < 1.2e-3     # the split shifts, not lost
    for _ in range(40):                             # calls now cheaper than the kept e: it cannot keep its price
        costs.observe_drafting([[0]], 1.0e-3, [0], 0.0)
    assert costs.drafting([1]) == pytest.approx(1.0e-3, rel=1e-3) and costs.per_draft_call == 0.0
    fresh = policy_with(lambda rows: 0.016 + 0.0006 * rows, {}).costs
    for _ in range(5):
        fresh.observe_drafting([[0]], 2.6e-3, [0], 0.0)
    assert (fresh.per_draft_step, fresh.per_draft_call) == (pytest.approx(2.6e-3), 0.0)


def test_calibration_keeps_each_row_counts_best_and_the_shape_of_few_rows(caplog):
    """T is measured at every row count a draft at one sequence reaches, in interleaved rounds, the first dropped (a
    new process's first forwards), each point's best kept, made non-decreasing. Its shape over a few rows is kept:
    SmolLM2's bf16 kernel is bound by the weights' reads up to ~6 rows (+0.4 ms a row) and by the CPU's dot products
    beyond (+5 ms), where a line through 1, 2, 4 and 8 rows priced the 4 rows of a k=4 verify at +6.9 ms (they cost
    +1.9). A chain's rows after its first are priced per slot at what they measured (its context is hot)."""
    calls = []
    kernel = lambda rows: 0.016 + 0.0004 * min(rows, 6) + 0.005 * max(0, rows - 6)
    chained = target_measure(kernel, 1.6e-6, 0.8e-6)

    def measure(rows, slots, chain=1):
        calls.append((rows, slots, chain))
        first = calls.count((rows, slots, chain)) == 1
        noisy = 0.004 if len(calls) % 7 == 0 else 0.0                   # now and then the host is busy
        dip = -0.001 if rows == 3 else 0.0                              # three rows measured below two
        return (chained(rows, slots, chain) + noisy + dip) * (5 if first else 1)
    policy = DraftPolicy(8)
    with caplog.at_level("INFO", logger="specserve.engine.step_costs"):
        policy.calibrate(measure)
    T = policy.costs.target
    assert {rows for rows, _, _ in calls} >= set(range(1, 10))
    assert "1 rows 16.4 ms, 2 rows 16.8 ms" in caplog.text       # the table, logged as the server starts
    assert float(T(5) - T(1)) == pytest.approx(0.0016, abs=1e-5)
    assert float(T(8) - T(6)) == pytest.approx(0.010, abs=1e-5)
    assert float(T(3)) == pytest.approx(float(T(2)))                    # the dip: no row looks free
    assert policy.costs.per_row_slot == pytest.approx(1.6e-6, rel=1e-3)
    assert policy.costs.per_chain_row_slot == pytest.approx(0.8e-6, rel=1e-3)


def test_calibration_keeps_the_drop_where_forwards_take_more_threads():
    """Where forwards from W rows take every core (the server, runtime/device.py), T drops at W: the table is
    non-decreasing on each side of it, measured at W - 1 and W, and rows from W are priced at what they cost,
    not lifted to the one-thread price of W - 1 rows. Without W it is non-decreasing throughout, as before."""
    W = 20
    kernel = lambda rows: 0.016 + 0.002 * rows if rows < W else 0.010 + 0.001 * rows
    costs, lifted = StepCosts(), StepCosts()
    costs.calibrate(target_measure(kernel), wide_from=W)
    lifted.calibrate(target_measure(kernel), wide_from=0)
    for rows in (1, 8, W - 1, W, 32, 64):
        assert float(costs.target(rows)) == pytest.approx(kernel(rows))
    table = lifted.target(np.arange(1, 65))
    assert np.all(np.diff(table) >= 0) and float(lifted.target(W)) >= kernel(16)


def test_steps_on_more_threads_correct_their_part_of_the_table():
    """Start-up calibration does not see the stalls the server's front end adds to a step on every core: steps from
    W rows correct T from W on (wide_ratio), steps below it the rest (scale), so the drop at W stays only as deep as
    measured steps show it. Drafts that bring a step to W rows otherwise looked nearly free."""
    W = 20
    kernel = lambda rows: 0.016 + 0.002 * rows if rows < W else 0.010 + 0.001 * rows
    costs = StepCosts()
    costs.calibrate(target_measure(kernel), wide_from=W)
    for _ in range(60):
        costs.observe_target(32, 1.5 * kernel(32))
    assert float(costs.target(32)) == pytest.approx(1.5 * kernel(32), rel=0.015)
    assert float(costs.target(W)) == pytest.approx(1.5 * kernel(W), rel=0.015)
    assert float(costs.target(W - 1)) == pytest.approx(kernel(W - 1))
    for _ in range(60):
        costs.observe_target(4, 1.2 * kernel(4))
    assert float(costs.target(8)) == pytest.approx(1.2 * kernel(8), rel=1e-3)
    assert float(costs.target(32)) == pytest.approx(1.2 * 1.5 * kernel(32), rel=0.015)   # its ratio to the rest kept
    for i in range(200):                # remade as the ratio moves, at its length: it grew 2x each time (OOM)
        costs.observe_target(32, (1.5 + 0.5 * (i % 2)) * kernel(32))
    assert len(costs.unscaled(64)) == 256


def test_calibration_measures_every_row_count_a_draft_at_one_sequence_reaches():
    from specserve.drafting.options import AUTO_MAX_DRAFT_TOKENS
    from specserve.engine.step_costs import CALIBRATION_ROWS
    assert set(range(1, AUTO_MAX_DRAFT_TOKENS + 2)) <= set(CALIBRATION_ROWS)


def test_a_chains_cheap_rows_buy_longer_drafts():
    """At one sequence of 550 slots a k=4 verify's rows after the first cost ~0.5 of a separate row's per slot
    (SmolLM2 at one thread): priced as separate rows they would hold a 0.6-acceptance draft shorter (at 2.4 us a
    slot, where that one row tips the choice)."""
    kernel = lambda rows: 0.016 + 0.0004 * rows
    dear, cheap = (policy_with(kernel, {1: 0.6}, per_row_slot=2.4e-6, per_chain_row_slot=rate) for rate in (2.4e-6, 1.2e-6))
    for p in (dear, cheap):
        p.costs.per_draft_token = 0.001
    lengths = [p.choose([Candidate(1, 8, context=550)], fixed_rows=1, num_fixed_tokens=1, fixed_slots=550)[0]
               for p in (dear, cheap)]
    assert lengths[0] < lengths[1]
    # a measured step less its attention at each rate leaves T as it was
    for p, rate in ((dear, 2.4e-6), (cheap, 1.2e-6)):
        before = float(p.costs.target(5))
        chain_slots = sum(550 + j for j in range(1, 5))
        p.costs.observe_step(5, 0, before + 2.4e-6 * 550 + rate * chain_slots, 550, chain_slots)
        assert float(p.costs.target(5)) == pytest.approx(before)


def test_slots_are_priced_on_the_threads_a_step_takes():
    """Where forwards from W rows take every core (the server), a slot costs more in a step under W rows, on one
    thread (SmolLM2 at 512 slots: 1.6-1.8 us against 1.0 at 32 rows on two; a chain's 0.8-0.9 against 0.3). s and
    s_chain are measured on both sides of W: priced at 32 rows' values, a draft's verify rows at one sequence of 550
    slots looked 0.2 ms cheaper each than they were, and a 0.6-acceptance draft came out longer than it pays."""
    W, kernel = 16, lambda rows: 0.016 + 0.0004 * rows
    narrow_measure, wide_measure = target_measure(kernel, 1.7e-6, 0.8e-6), target_measure(kernel, 1.0e-6, 0.3e-6)
    measure = lambda rows, slots, chain=1: (narrow_measure if rows < W else wide_measure)(rows, slots, chain)
    threads, one_price = DraftPolicy(8), DraftPolicy(8)
    threads.costs.calibrate(measure, wide_from=W)
    one_price.costs.calibrate(wide_measure, wide_from=0)      # what the policy priced every step at before
    assert threads.costs.slot_prices(5) == pytest.approx((1.7e-6, 0.8e-6))
    assert threads.costs.slot_prices(W) == threads.costs.slot_prices(64) == pytest.approx((1.0e-6, 0.3e-6))
    assert one_price.costs.slot_prices(5) == pytest.approx((1.0e-6, 0.3e-6))
    for p in (threads, one_price):
        p.costs.per_draft_token = 0.0005
        teach(p, {1: 0.6})
    lengths = [p.choose([Candidate(1, 8, context=550)], fixed_rows=1, num_fixed_tokens=1, fixed_slots=550)[0]
               for p in (threads, one_price)]
    assert 0 < lengths[0] < lengths[1]
    # a one-thread step measured at its own slots' time leaves T as it was; a step from W rows at the wide prices
    for rows, (s, s_chain) in ((5, (1.7e-6, 0.8e-6)), (W + 4, (1.0e-6, 0.3e-6))):
        before, chain_slots = float(threads.costs.target(rows)), sum(550 + j for j in range(1, rows))
        threads.costs.observe_step(rows, 0, before + s * 550 + s_chain * chain_slots, 550, chain_slots)
        assert float(threads.costs.target(rows)) == pytest.approx(before)


def test_a_new_sequence_starts_from_the_methods_rate():
    policy = policy_with(lambda rows: 0.01 + 0.0001 * rows, {1: 0.9})
    assert policy.acceptance(99)[0] > 0.8          # learned from sequence 1, through the method-wide prior
    policy.forget(1)
    assert 1 not in policy.seqs


def test_step_costs_follow_measured_times_and_stay_monotone():
    costs = StepCosts(rows=np.array([1, 2, 4, 8, 16, 32, 64, 128], dtype=float))
    costs.seconds = np.array([1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 5.0, 9.0])
    assert costs.target(12) == pytest.approx(1.5) and costs.target(256) == pytest.approx(17.0)
    for _ in range(50):
        costs.observe_target(8, 3.0)
    assert costs.target(8) == pytest.approx(3.0, rel=0.05)
    # one factor for every row count: steps at some rows never flatten the table past them (rows there looked free)
    assert costs.target(np.array([1, 32, 128, 256])) == pytest.approx(3.0 * np.array([1.0, 3.0, 9.0, 17.0]), rel=0.05)
    costs.observe_drafting([[0] * 4], 0.04, [0], 0.0)
    costs.observe_drafting([[0] * 4], 0.08, [0], 0.0)
    assert costs.drafting([4]) == pytest.approx(0.06)


def random_lengths(engine, seed: int):
    """Replace the engine's policy choice with random lengths within each sequence's cap."""
    rng = np.random.default_rng(seed)
    engine.policy.choose_afresh = lambda candidates, *_: [int(rng.integers(0, c.max_tokens + 1)) for c in candidates]


@pytest.fixture(scope="module")
def plain_ids():
    llm = LLM(str(DEMO), speculative_method="none")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32,
                                                                                 ignore_eos=True))]


@pytest.mark.parametrize("method,options", [("ngram", {}), ("draft", {}), ("eagle3", {}), ("mtp", {}),
                                            ("eagle3", {"tree_depth": 3, "branching_factor": 2})],
                         ids=["ngram", "draft", "eagle3", "mtp", "eagle3-tree"])
def test_greedy_output_does_not_depend_on_the_chosen_lengths(method, options, plain_ids):
    llm = LLM(str(DEMO), speculative_method=method)
    params = SamplingParams.from_dict({"temperature": 0, "max_tokens": 32, "ignore_eos": True, **options})
    assert params.num_assistant_tokens is None                  # resolves to the built-in "auto"
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == plain_ids
    random_lengths(llm.engine, seed=0)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == plain_ids
    lengths = [k for o in outs for k in o.spec["draft_lengths"]]
    assert len(set(lengths)) > 3 and sum(o.spec["num_accepted_tokens"] for o in outs) > 0


def test_a_draft_models_backlog_is_caught_up_apart_timed_and_priced_per_token(plain_ids):
    """A draft model resuming after steps held at 0 runs over its backlog in a forward of its own, timed apart
    (Proposer.catch_up_seconds) and fitted as a catch-up; the one or two tokens a drafting step leaves ride in its
    first draft forward. Merged, a probe's catch-up over a sonnet prompt was priced as the call's own cost (e 2.9 ms
    against 0.9) and "auto" held drafts that were faster than plain decoding. Output stays exact."""
    llm = LLM(str(DEMO), speculative_method="draft")
    proposer, costs, steps = llm.engine.proposer, llm.engine.policy.costs, iter(range(10 ** 6))
    # drafting every 10th step only: each draft follows a backlog of 9 or more tokens (a prompt, the steps held)
    llm.engine.policy.choose_afresh = lambda candidates, *_: [c.max_tokens if next(steps) % 10 == 0 else 0
                                                             for c in candidates]
    catch_up, backlogs = proposer._catch_up, []

    def slow(seqs):
        backlogs.extend(proposer.catch_up_tokens(seq) for seq in seqs)
        time.sleep(0.03)
        return catch_up(seqs)
    proposer._catch_up = slow
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == plain_ids
    assert len(backlogs) >= 3 and min(backlogs) >= 8 and costs.catch_up_fit.count >= 3
    assert costs.drafting([1], [16]) - costs.drafting([1]) >= 0.02 and costs.drafting([1]) < 0.01
    # steps that draft in a row leave no backlog the next draft runs apart
    llm.engine.policy.choose_afresh = lambda candidates, *_: [c.max_tokens for c in candidates]
    backlogs.clear()
    out = llm.generate(PROMPTS[0], params)[0]
    assert out.outputs[0].token_ids == plain_ids[0] and len(backlogs) <= 1


@pytest.mark.parametrize("method", ["draft", "mtp", "eagle3"])
def test_confidence_threshold_stops_chains_and_keeps_output(method, plain_ids):
    llm = LLM(str(DEMO), speculative_method=method)
    base = {"temperature": 0, "max_tokens": 32, "ignore_eos": True, "num_assistant_tokens": 6}
    free = llm.generate(PROMPTS, SamplingParams.from_dict(base))
    sure = llm.generate(PROMPTS, SamplingParams.from_dict({**base, "assistant_confidence_threshold": 1.0}))
    assert [o.outputs[0].token_ids for o in sure] == plain_ids
    # nothing is drawn with probability 1: every draft stops after its first token
    assert all(o.spec["num_draft_tokens"] == o.spec["num_drafts"] > 0 for o in sure)
    assert sum(o.spec["num_draft_tokens"] for o in free) > sum(o.spec["num_draft_tokens"] for o in sure)


def test_auto_reports_its_lengths_and_a_fixed_number_is_obeyed():
    llm = LLM(str(DEMO), speculative_method="draft", num_assistant_tokens=4)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert set(out.spec["draft_lengths"][:-4]) == {4}
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                  num_assistant_tokens="auto"))[0]
    # one per decode step: every target forward but the prompt's
    assert len(out.spec["draft_lengths"]) == out.spec["num_target_forwards"] - 1 and max(out.spec["draft_lengths"]) <= 8


def test_prompt_rows_are_costed_apart_from_decode_rows():
    costs = StepCosts(rows=np.array([1, 2, 4, 8, 16, 32, 64, 128], dtype=float))
    costs.seconds = np.array([1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 5.0, 9.0])
    table = costs.seconds.copy()
    for _ in range(20):
        costs.observe_step(decode_rows=4, prompt_rows=500, seconds=1.0 + 500 * 0.001)   # T(4) = 1, then P
    assert (costs.seconds == table).all() and costs.per_prompt_row == pytest.approx(0.001)
    costs.observe_step(decode_rows=4, prompt_rows=0, seconds=2.0)                     # decode-only: the table
    assert costs.target(4) > 1.0


@pytest.mark.parametrize("k", [6, "auto"])
def test_ngram_reserves_only_what_its_lookup_drafts(k, plain_ids):
    """A step's draft slots (the usage's draft_lengths, the token budget) are the tokens the lookup found, so that
    neither the scheduler nor "auto" counts rows that never come."""
    llm = LLM(str(DEMO), speculative_method="ngram", ngram_cache=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, num_assistant_tokens=k))
    assert [o.outputs[0].token_ids for o in outs] == plain_ids
    lengths = [n for o in outs for n in o.spec["draft_lengths"]]
    assert sum(o.spec["num_draft_tokens"] for o in outs) == sum(lengths) > 0
    if k == 6:
        assert 0 in lengths and 6 in lengths           # the lookup found nothing at some steps, all six at others


def bernoulli_drafts(policy: DraftPolicy, rates: dict[int, float], drafts: int, seed: int = 0) -> None:
    """Interleaved one-token drafts for each sequence, accepted at its rate."""
    rng = np.random.default_rng(seed)
    for _ in range(drafts):
        for seq_id, rate in rates.items():
            policy.observe(seq_id, 1, int(rng.random() < rate))


def test_a_record_that_predicts_nothing_is_shrunk_to_the_methods_rate():
    """Sequences alike (every draft accepted at 0.3 whatever came before): a run of rejections is noise, and a
    sequence's first-token estimate stays near the method's rate where the weight W = 4 took it near the break-even."""
    policy = policy_with(lambda rows: 0.013 + 0.0004 * rows, {})
    bernoulli_drafts(policy, {i: 0.3 for i in range(8)}, 60)
    assert policy.dispersion.weights(policy.prior())[0] > 30
    for _ in range(6):
        policy.observe(99, 1, 0)
    own = policy.stats(99).rates(policy.prior(), 4.0)[0]
    assert own < 0.17 < policy.acceptance(99)[0] == pytest.approx(policy.prior()[0], abs=0.03)


def test_sequences_that_differ_keep_their_own_record():
    """Half the sequences accept 0.9, half 0.1: the spread is wide, W stays at its floor and each estimate follows
    its sequence (the high ones draft longer)."""
    policy = policy_with(lambda rows: 0.013 + 0.0004 * rows, {})
    rates = {i: 0.9 if i % 2 else 0.1 for i in range(8)}
    bernoulli_drafts(policy, rates, 60)
    assert policy.dispersion.weights(policy.prior())[0] == pytest.approx(4.0)
    assert policy.acceptance(1)[0] > 0.7 and policy.acceptance(2)[0] < 0.4
    lengths = policy.choose([Candidate(i, 8) for i in (1, 2)], fixed_rows=2, num_fixed_tokens=2)
    assert lengths[0] > lengths[1]


def test_the_weight_starts_at_its_floor():
    policy = DraftPolicy(8)
    assert policy.dispersion.weights(policy.prior()) == [4.0] * 8
