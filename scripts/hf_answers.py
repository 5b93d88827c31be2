"""`specserve train data` with transformers' `generate` answering the prompts instead of specserve's engine.

The fallback of scripts/train_drafters_gpu.sh, for a GPU where the engine fails: the same prompts, chat template,
temperatures, answer length and recording pass (specserve's own model), only the answers come from
transformers' batched `generate` on the same converted checkpoint. Takes `specserve train data`'s arguments.
Per-request seeds do not exist there: each batch of one temperature is seeded with its first request's seed.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import specserve.llm
from specserve.tokenizer import Tokenizer
from specserve.train.cli import main


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    outputs: list[_Completion]


class TransformersAnswers:
    """What run_data uses of specserve.llm.LLM: .tokenizer and .generate(ids, params)."""

    def __init__(self, model: str, max_num_seqs: int = 256, device: str = "cuda", **_):
        from transformers import AutoModelForCausalLM
        self.tokenizer = Tokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device).eval()
        self.device = device
        self.stop = sorted(self.tokenizer.eos_token_ids)
        self.pad = self.stop[0]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: list) -> list[_Output]:
        results: list[list[int] | None] = [None] * len(prompts)
        for temperature in sorted({p.temperature for p in params}):
            index = [i for i, p in enumerate(params) if p.temperature == temperature]
            width = max(len(prompts[i]) for i in index)
            ids = torch.full((len(index), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(index), width), dtype=torch.long)
            for row, i in enumerate(index):          # left-padded
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            torch.manual_seed(params[index[0]].seed or 0)
            sampled = temperature > 0
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=params[index[0]].max_tokens, do_sample=sampled,
                                      temperature=temperature if sampled else None, top_k=0 if sampled else None,
                                      top_p=1.0 if sampled else None, eos_token_id=self.stop, pad_token_id=self.pad)
            for row, i in enumerate(index):
                answer = out[row, width:].tolist()
                end = next((n for n, t in enumerate(answer) if t in self.stop), None)
                results[i] = answer if end is None else answer[:end + 1]    # the end-of-turn token kept
        return [_Output([_Completion(r)]) for r in results]


if __name__ == "__main__":
    specserve.llm.LLM = TransformersAnswers
    main(["train", "data", *sys.argv[1:]])
