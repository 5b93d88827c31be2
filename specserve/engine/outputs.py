"""What the engine hands out per step, and the error a request it cannot serve gets."""
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
