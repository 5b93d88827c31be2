"""Benchmark prompts, built the way `vllm bench serve` builds them so that results compare across tools."""
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from specserve.config import data_file

SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"


class TokenizerLike(Protocol):
    """What prompt building needs; specserve.tokenizer.Tokenizer has it."""
    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def as_user_turn(tokenizer: TokenizerLike, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def default_sonnet_path() -> Path:
    """The sonnet text `vllm bench serve --dataset-name sonnet` reads (Shakespeare's sonnets, public domain),
    shipped with the package so that a fresh install can benchmark without a download."""
    return data_file("sonnet.txt")


def sample_sonnet(lines: list[str], tokenizer: TokenizerLike, num_requests: int, input_len: int = 550,
                  output_len: int = 150, prefix_len: int = 200, seed: int = 0,
                  return_prompt_formatted: bool = False) -> list[SampleRequest]:
    """vLLM's SonnetDataset: a fixed instruction, a shared prefix of the file's first lines, then lines drawn
    with replacement. Lengths are measured on the chat-formatted prompt and every sample fits in `input_len`.

    `random.Random(seed)` draws the same lines as vLLM's `random.seed(seed); random.choices(...)`.
    """
    rng = random.Random(seed)
    avg_line_len = sum(len(tokenizer.encode(line)) for line in lines) / len(lines)
    base_offset = len(tokenizer.encode(as_user_turn(tokenizer, SONNET_BASE_PROMPT)))
    if input_len <= base_offset:
        raise ValueError(f"sonnet input length {input_len} must exceed the base prompt's {base_offset} tokens")
    num_input_lines = round((input_len - base_offset) / avg_line_len)
    num_prefix_lines = max(round((prefix_len - base_offset) / avg_line_len), 0)
    prefix_lines = lines[:num_prefix_lines]

    samples: list[SampleRequest] = []
    for _ in range(100 * num_requests):  # vLLM retries forever; a bound turns a bad length into an error
        if len(samples) == num_requests:
            return samples
        extra_lines = rng.choices(lines, k=num_input_lines - num_prefix_lines)
        prompt = SONNET_BASE_PROMPT + "".join(prefix_lines + extra_lines)
        formatted = as_user_turn(tokenizer, prompt)
        prompt_len = len(tokenizer.encode(formatted))
        if prompt_len <= input_len:
            samples.append(SampleRequest(formatted if return_prompt_formatted else prompt, prompt_len, output_len))
    if len(samples) < num_requests:
        raise ValueError(f"could not build {num_requests} sonnet prompts within {input_len} tokens")
    return samples


def load_sonnet(path: str | Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.readlines()


def sample_random(tokenizer: TokenizerLike, num_requests: int, input_len: int = 1024, output_len: int = 128,
                  prefix_len: int = 0, range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """vLLM's RandomDataset: lengths uniform in [len * (1 - r), len * (1 + r)], a shared random prefix, then
    consecutive ids from a random offset; decoded and re-encoded until the token count holds."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    num_special = len(tokenizer.encode("", add_special_tokens=True))
    real_input_len = max(0, input_len - num_special)
    input_lens = rng.integers(int(np.floor(real_input_len * (1 - range_ratio))),
                              int(np.ceil(real_input_len * (1 + range_ratio))) + 1, size=num_requests)
    output_lens = rng.integers(max(int(np.floor(output_len * (1 - range_ratio))), 1),
                               max(int(np.ceil(output_len * (1 + range_ratio))), 1) + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)
    allowed = np.array(sorted(set(range(tokenizer.vocab_size)) - set(tokenizer.all_special_ids)))
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []

    samples = []
    for i in range(num_requests):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        prompt, ids = fit_to_length(tokenizer, prefix + inner, prefix_len + int(input_lens[i]), allowed, rng)
        samples.append(SampleRequest(prompt, len(ids), int(output_lens[i])))
    return samples


def fit_to_length(tokenizer: TokenizerLike, ids: list[int], target_len: int, allowed: np.ndarray,
                  rng: np.random.Generator, max_retries: int = 10) -> tuple[str, list[int]]:
    """Decoding n ids and re-encoding need not give n ids; pad or cut until it does (or retries run out)."""
    for attempt in range(max_retries + 1):
        prompt = tokenizer.decode(ids)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if len(ids) == target_len or attempt == max_retries:
            break
        if len(ids) < target_len:
            ids = ids + allowed[rng.integers(0, len(allowed), size=target_len - len(ids))].tolist()
        else:
            ids = ids[:target_len]
    return prompt, ids


def load_jsonl_prompts(path: str | Path) -> list[str]:
    """One prompt per line, from a `prompt` string, the first of `turns`, or a `question` string."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "prompt" in record:
                prompt = record["prompt"]
            elif "turns" in record:
                first = record["turns"][0]
                prompt = first["content"] if isinstance(first, dict) else first
            elif "question" in record:
                prompt = record["question"]
            else:
                raise ValueError(f"{path}:{line_no}: no 'prompt', 'turns' or 'question' field")
            prompts.append(str(prompt))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def sample_jsonl(prompts: list[str], tokenizer: TokenizerLike | None, num_requests: int, output_len: int = 256,
                 return_prompt_formatted: bool = False) -> list[SampleRequest]:
    """The file's prompts in order, repeated when there are fewer than `num_requests`."""
    samples = []
    for i in range(num_requests):
        prompt = prompts[i % len(prompts)]
        formatted = as_user_turn(tokenizer, prompt) if tokenizer is not None else prompt
        prompt_len = len(tokenizer.encode(formatted)) if tokenizer is not None else 0
        samples.append(SampleRequest(formatted if return_prompt_formatted else prompt, prompt_len, output_len))
    return samples
