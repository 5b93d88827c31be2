from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from specserve.structured_output import StructuredOutput

# limits on what one request may ask of the engine (the server answers 400 beyond them)
MAX_TEMPERATURE = 2.0                 # OpenAI's maximum
MIN_TEMPERATURE = 1e-2                # a positive temperature below it is raised to it, as vLLM does: smaller
                                      # ones overflow the logits in float32 (1e-300 is 0 there)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and speculative settings, shaped like vLLM's.

    num_assistant_tokens and draft_options (the serving method's own options by name, e.g. tree_depth: see
    drafting/options.py) left unset resolve when the engine admits the request: the engine's flag, then the
    model's generation_config.json, then the option's default.
    """
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1 = off
    seed: int | None = None
    max_tokens: int | None = 16       # None = until EOS or the context is full
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0     # OpenAI's: minus this where a token is in the output (-2 to 2)
    frequency_penalty: float = 0.0    # minus this times the token's count in the output (-2 to 2)
    repetition_penalty: float = 1.0   # vLLM's / transformers': over prompt and output tokens (> 0; 1 = off)
    min_tokens: int = 0               # EOS and stop_token_ids masked until the output has this many tokens
    min_p: float = 0.0                # drop tokens below min_p x the most likely one's probability
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit (-100 to 100)
    structured: StructuredOutput | None = None   # a grammar the output follows (structured_output.py)
    logprobs: int | None = None       # the target's logprob of each output token, and this many top ones; None: off
    prompt_logprobs: int | None = None   # the same for the prompt's tokens (from the second on); None: off
    # speculative decoding
    num_assistant_tokens: int | str | None = None    # "auto": chosen per step (engine/draft_policy.py)
    draft_options: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k < 0:
            self.top_k = 0
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        if any(len(stop) > MAX_STOP_STRING_CHARS for stop in self.stop):
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {getattr(self, name)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}
        if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.num_assistant_tokens, int) and self.num_assistant_tokens < 0:
            raise ValueError(f"num_assistant_tokens must be >= 0, got {self.num_assistant_tokens}")

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """From settings shaped like a request body: SamplingParams' fields, and any other key a drafting option
        (SamplingParams.from_dict({"temperature": 0, "tree_depth": 2})); the engine checks those on admission."""
        own = {f.name for f in fields(cls)} - {"draft_options"}
        return cls(**{k: v for k, v in values.items() if k in own},
                   draft_options={**values.get("draft_options", {}), **{k: v for k, v in values.items()
                                                                       if k not in own and k != "draft_options"}})

    @property
    def auto_draft(self) -> bool:
        return self.num_assistant_tokens == "auto"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_tensors(params: list[SamplingParams], rows_each: int = 1, device=None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """compute_probs' temperature, top_k, top_p and min_p for these requests, each repeated for rows_each rows."""
    temperature = torch.tensor([p.temperature for p in params]).repeat_interleave(rows_each)
    top_k = torch.tensor([p.top_k for p in params]).repeat_interleave(rows_each)
    top_p = torch.tensor([p.top_p for p in params]).repeat_interleave(rows_each)
    min_p = torch.tensor([p.min_p for p in params]).repeat_interleave(rows_each)
    return temperature.to(device), top_k.to(device), top_p.to(device), min_p.to(device)
