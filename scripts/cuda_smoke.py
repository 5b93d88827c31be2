"""specserve's engine on a GPU against transformers on the same checkpoint: greedy tokens equal, and timings.

    python scripts/cuda_smoke.py MODEL_DIR [NUM_PROMPTS] [MAX_TOKENS] [DEVICE]
"""
from __future__ import annotations

import json
import sys
import time

import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_answers import TransformersAnswers  # noqa: E402


def main(model: str, num: int = 16, max_tokens: int = 32, device: str = "cuda") -> dict:
    prompts = [[1] + [100 + (7 * i + j) % 5000 for j in range(8 + i % 5)] for i in range(num)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    report = {}
    t = time.monotonic()
    llm = LLM(model, speculative_method="none", max_num_seqs=num, kv_cache_memory_gb=2.0, device=device)
    report["engine_load_s"] = time.monotonic() - t
    for run in ("engine_first_s", "engine_second_s"):
        t = time.monotonic()
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        report[run] = time.monotonic() - t
    hf = TransformersAnswers(model, device=device)
    hf.stop = [-1]          # no stop: max_tokens each, as ignore_eos
    t = time.monotonic()
    theirs = [o.outputs[0].token_ids for o in hf.generate(prompts, params)]
    report["transformers_s"] = time.monotonic() - t
    report["equal_sequences"] = sum(a == b for a, b in zip(ours, theirs))
    report["equal_prefix_tokens"] = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                        for a, b in zip(ours, theirs))
    report |= {"num": num, "max_tokens": max_tokens, "device": device,
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    return report


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0], *(int(a) for a in args[1:3]), *args[3:4]), indent=2))
