"""The engine's side of `num_assistant_tokens: "auto"` (engine/draft_policy.py): the scheduled sequences' draft
lengths, chosen before the step's token budget is spent, and each step's measured time, for the cost model."""
from __future__ import annotations

from specserve.engine.draft_policy import Candidate, DraftPolicy
from specserve.engine.step_costs import chain_slots


def choose_draft_lengths(policy: DraftPolicy, scheduled: list, catch_up=lambda seq: 0) -> None:
    """The "auto" sequences' num_draft_tokens in a step (engine/scheduler.py ScheduledSeq, each at its longest):
    the policy's choice for the whole step. The scheduler asks before it spends the step's token budget, so
    that the draft slots it does not choose go to prompt chunks. catch_up(seq): Proposer.catch_up_tokens."""
    auto = [s for s in scheduled if s.num_draft_tokens > 0 and s.seq.params.auto_draft]
    if auto:
        choose_auto(policy, scheduled, auto, catch_up)


def choose_auto(policy: DraftPolicy, scheduled: list, auto: list, catch_up) -> None:
    lengths = [0] * len(auto)
    if not policy.repeat_hold(tuple(s.seq.seq_id for s in auto)):
        decoding = [s for s in scheduled if s.num_new == 1]
        fixed = [1 + (0 if s.seq.params.auto_draft else s.num_draft_tokens) for s in decoding]
        remaining = lambda seq: 1 << 16 if seq.params.max_tokens is None else \
            seq.params.max_tokens - seq.num_output_tokens
        lengths = policy.choose_afresh(
            [Candidate(s.seq.seq_id, s.num_draft_tokens, s.seq.num_computed_tokens + 1, catch_up(s.seq),
                       remaining(s.seq)) for s in auto], sum(fixed), sum(s.completes_prompt for s in scheduled),
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
