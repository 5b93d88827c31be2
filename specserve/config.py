from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SPEC_METHODS = ("none", "ngram", "draft", "eagle3", "mtp")
MAX_NUM_ASSISTANT_TOKENS = 32


def default_model_dir() -> Path:
    """The demo model shipped inside the package."""
    return Path(__file__).parent / "demo_model"


@dataclass(slots=True)
class SpecDefaults:
    """Speculative settings a request inherits when it does not set them."""
    num_assistant_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    branching_factor: int = 2
    tree_depth: int = 0

    @classmethod
    def from_generation_config(cls, model_dir: str | Path) -> SpecDefaults:
        """Built-in defaults overridden by the model's generation_config.json."""
        defaults = cls()
        path = Path(model_dir) / "generation_config.json"
        if path.exists():
            gen = json.loads(path.read_text())
            if "max_ngram_size" in gen and "prompt_lookup_max" not in gen:
                gen["prompt_lookup_max"] = gen["max_ngram_size"]
            for name in cls.__slots__:
                if isinstance(gen.get(name), int):
                    setattr(defaults, name, gen[name])
        return defaults


@dataclass(slots=True)
class EngineConfig:
    model: str | Path = field(default_factory=default_model_dir)
    dtype: str = "auto"                       # auto: the checkpoint's dtype on CUDA; on CPU bf16 if it is bf16, else fp32
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0           # budget for all KV caches (target and drafter)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None          # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None            # CPU intra-op threads; None: 1 for models whose weights fit in cache
    # speculative decoding
    speculative_method: str | None = None     # None: detected (a drafter found beside the model), else "none"
    draft_model: str | Path | None = None
    num_assistant_tokens: int | None = None   # engine-wide default; requests may override
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    branching_factor: int | None = None
    tree_depth: int | None = None
    ngram_cache: bool = True                  # cross-request n-gram cache (n-gram method)

    def __post_init__(self):
        if self.speculative_method is not None and self.speculative_method not in SPEC_METHODS:
            raise ValueError(f"speculative_method must be one of {SPEC_METHODS}, got {self.speculative_method!r}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_assistant_tokens is not None and not 0 <= self.num_assistant_tokens <= MAX_NUM_ASSISTANT_TOKENS:
            raise ValueError(f"num_assistant_tokens must be in [0, {MAX_NUM_ASSISTANT_TOKENS}]")
