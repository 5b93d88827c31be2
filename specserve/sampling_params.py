from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and speculative settings, shaped like vLLM's.

    Speculative fields left at None resolve, in order, from the model's generation_config.json
    and then the built-in defaults (see specserve.config.SpecDefaults).
    """
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1 = off
    seed: int | None = None
    max_tokens: int | None = 16       # None = until EOS or the context is full
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # speculative decoding
    num_assistant_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    branching_factor: int | None = None
    tree_depth: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k < 0:
            self.top_k = 0
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.prompt_lookup_min is not None and self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max is not None and self.prompt_lookup_max < max(1, self.prompt_lookup_min or 1):
            raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min and >= 1, got {self.prompt_lookup_max}")
        if self.branching_factor is not None and self.branching_factor < 1:
            raise ValueError(f"branching_factor must be >= 1, got {self.branching_factor}")
        if self.tree_depth is not None and self.tree_depth < 0:
            raise ValueError(f"tree_depth must be >= 0, got {self.tree_depth}")
        if self.num_assistant_tokens is not None and self.num_assistant_tokens < 0:
            raise ValueError(f"num_assistant_tokens must be >= 0, got {self.num_assistant_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
