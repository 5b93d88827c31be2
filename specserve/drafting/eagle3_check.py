"""The start-up check of an EAGLE3 head against its target: first-step greedy agreement on a few built-in prompts,
with a hint when the neighbouring layer convention does much better (the classic trap)."""
from __future__ import annotations

import logging

import torch

from specserve.models.eagle3 import Eagle3Head
from specserve.tokenizer import Tokenizer

logger = logging.getLogger("specserve.drafting.eagle3")

# a short built-in prompt set for the start-up check of the head against its target
CHECK_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n    if n == 0:\n        return 1\n    return n * factorial(n - 1)\n",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
    "arrows of outrageous fortune, or to take arms against a sea of troubles.",
    "import os\nimport sys\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n",
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital of Italy is Rome.",
]
NEAR_ZERO_ACCEPTANCE = 0.1


@torch.inference_mode()
def check_acceptance(head: Eagle3Head, layers: tuple[int, ...], target: torch.nn.Module, tokenizer: Tokenizer,
                     dtype: torch.dtype, device: torch.device) -> float:
    """First-step greedy agreement of head and target on CHECK_PROMPTS, logged; a warning when near
    zero, naming the neighbouring layer choice when that one does much better (the classic trap)."""
    L = target.config.num_hidden_layers
    candidates = [layers] + [tuple(i + d for i in layers) for d in (-1, 1)]
    candidates = [c for c in candidates if all(0 <= i <= L for i in c)]
    total = {c: [0, 0] for c in candidates}
    for text in CHECK_PROMPTS:
        ids = torch.tensor([tokenizer.encode(text)], device=device)             # [1, T]
        T = ids.shape[1]
        if T < 3:
            continue
        final, aux = target(ids, torch.arange(T, device=device), None, tuple(range(L + 1)))
        want = target.compute_logits(final[0, 1:]).argmax(-1)                               # [T-1]
        for c in candidates:
            states = torch.cat([aux[i][0, :-1] for i in sorted(c)], dim=-1).to(dtype)   # [T-1, 3H]
            out = head(ids[:, 1:], head.fc(states)[None], torch.arange(T - 1, device=device))
            got = head.target_ids(head.draft_logits(out[0]).argmax(-1))
            total[c][0] += int((got == want).sum())
            total[c][1] += T - 1
    rates = {c: hit / max(1, n) for c, (hit, n) in total.items()}
    rate = rates[layers]
    logger.info("EAGLE3 head: first-step greedy acceptance %.2f on the built-in prompts", rate)
    if rate < NEAR_ZERO_ACCEPTANCE:
        better = max(rates, key=rates.get)
        hint = ""
        if better != layers and rates[better] > 2 * rate + 0.05:
            hint = (f"; reading layers {list(better)} instead gives {rates[better]:.2f}: the head was probably "
                    f"trained with another layer convention (set eagle_aux_hidden_state_layer_ids in its config)")
        logger.warning("EAGLE3 head: first-step acceptance is near zero (%.2f) with target layers %s: is it "
                       "trained for this target?%s", rate, list(layers), hint)
    return rate
