from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
