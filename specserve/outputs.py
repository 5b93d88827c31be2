from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestOutput:
    """One request's result, shaped like vLLM's."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec: dict = field(default_factory=dict)        # SpecStats.to_dict()
    ttft_s: float | None = None                     # arrival to first token
    decode_s: float | None = None                   # first token to last token
    
    @property
    def decode_tokens_per_second(self) -> float | None:
        n = len(self.outputs[0].token_ids) - 1
        if not self.decode_s or n <= 0:
            return None
        return n / self.decode_s
