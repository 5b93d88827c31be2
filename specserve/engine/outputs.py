"""What the engine hands out per step, its drafting gauges, and the error a request it cannot serve gets."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.logprobs import TokenLogprob
from specserve.runtime.sequence import SeqSnapshot


class RequestError(ValueError):
    """A request the engine cannot serve (bad settings, a prompt that can never fit)."""


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    seq: SeqSnapshot                      # the request's state after this step
    error: str | None = None              # set when the request's step failed: it finished without its tokens
    new_logprobs: list[TokenLogprob] = field(default_factory=list)    # of new_token_ids, when the request asks


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
