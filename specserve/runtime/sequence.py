from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

from specserve.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class SpecStats:
    """Speculative-decoding statistics, per request and (summed) per engine."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_target_forwards: int = 0              # decode forwards of the target for this request
    draft_lengths: list[int] = field(default_factory=list)   # per decode step, the draft length chosen (a
    #                                           request's own; summed stats keep none)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted > 0:
            self.num_drafts += 1
            self.num_draft_tokens += num_drafted
            self.num_accepted_tokens += num_accepted
            if len(self.accepted_per_position) < num_drafted:
                self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
            for i in range(num_accepted):
                self.accepted_per_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_target_forwards += other.num_target_forwards
        if len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position.extend([0] * (len(other.accepted_per_position) - len(self.accepted_per_position)))
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per drafted target forward: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "num_target_forwards": self.num_target_forwards,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_lengths": list(self.draft_lengths),
        }


@dataclass(frozen=True, slots=True)
class SeqSnapshot:
    """A request's state after one engine step, for readers outside the engine thread (responses,
    metrics, the offline API): it never changes once taken, while the Sequence goes on being stepped."""
    seq_id: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int
    output_text: str
    finish_reason: str | None
    stop_reason: int | str | None
    spec: SpecStats
    arrival_time: float
    first_token_time: float | None
    logprobs: tuple = ()                     # TokenLogprob of each output token, when the request asks
    prompt_logprobs: tuple = ()              # TokenLogprob of prompt tokens 1.., when the request asks

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


_counter = itertools.count()


class Sequence:
    """One request's token state. token_ids = prompt + output; the first num_computed_tokens of them
    have their K/V in the target's cache (the block table covers at least that many)."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None):
        self.seq_id = next(_counter)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_token_ids = tuple(prompt_token_ids)   # shared by every snapshot
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0            # prompt tokens served from the prefix cache
        self.num_drafter_computed = 0         # tokens whose K/V a drafter's own cache holds
        self.drafter_start = 0                # its first valid slot: > 0 after a restart past its K/V (drafting/catch_up.py)
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0            # leading blocks registered in the prefix cache
        self.num_drafter_blocks = 0           # of those, leading blocks registered with the drafter's K/V too
        self.output_text = ""                 # detokenized output, stop strings cut
        self.num_emitted_chars = 0            # of output_text, already returned to the caller
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None
        self.spec = SpecStats()
        self.num_assistant_tokens = 0         # resolved per request by the engine
        self.seed = params.seed                # the engine draws one for unseeded requests
        self.arrival_time = 0.0
        self.first_token_time: float | None = None
        self.logprobs: list = []              # TokenLogprob of each output token, when the request asks
        self.prompt_logprobs: list = []       # TokenLogprob of prompt tokens 1.. (token 0 has none), when asked
        self.grammar = None                   # structured_output.Grammar, advanced by the committed tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_drafter_valid(self) -> int:
        """Leading tokens whose K/V the drafter's cache holds from a full history: what a prefix-cache hit resumes."""
        return 0 if self.drafter_start else self.num_drafter_computed

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def snapshot(self) -> SeqSnapshot:
        s = self.spec
        spec = SpecStats(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_position),
                         s.num_target_forwards, list(s.draft_lengths))
        return SeqSnapshot(self.seq_id, self.request_id, self.prompt_token_ids, self.num_output_tokens,
                           self.output_text, self.finish_reason, self.stop_reason, spec, self.arrival_time,
                           self.first_token_time, tuple(self.logprobs), tuple(self.prompt_logprobs))
