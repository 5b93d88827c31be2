import os

# PyTorch's CPU allocator backs each buffer of 2 MiB and more (weights, packed weights, KV caches) with transparent
# huge pages when THP_MEM_ALLOC_ENABLE is set at the process's first CPU allocation (importing torch makes none). Decode
# streams every weight once a step, and on 4 KiB pages a 270 MB bf16 model is 66,000 TLB entries a step: plain decoding
# of SmolLM2 ran 2-4% faster at one sequence and steadier from round to round (benchmarks/NOTES.md, session 47). An
# explicit setting in the environment (THP_MEM_ALLOC_ENABLE=0) is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from specserve.llm import LLM  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
