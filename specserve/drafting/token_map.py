"""A reduced draft vocabulary: the drafter's head scores only the tokens its target emits most often.

A draft model or an MTP layer spends most of a draft token on its output head: SmolLM2's 49,152 x 576 head
is ~85% of an MTP layer's bytes and ~90% of the shipped draft model's. FR-Spec (Zhao et al., 2025,
"FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling") keeps
the head's rows for the most frequent tokens only; SGLang reads the same list from
`--speculative-token-map`. The target still scores the whole vocabulary, so exactness is untouched:
a greedy draft is a proposal like any other, and a sampled one is drawn from q restricted (renormalised) to
the map, which is the q verification then uses (q is 0 outside it, so no such token is ever proposed).

The map is a list of target token ids: `token_map.json` in the drafter's folder (written by `specserve
train draft` / `train mtp`, or `specserve train token-map`), or a file given with `--speculative-token-map`
(JSON, or SGLang's torch-saved tensor); `--speculative-token-map none` keeps the full head.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.layers.linear import inference_linears
from specserve.layers.quantization import HEAD_QUANTIZATION

TOKEN_MAP_FILE = "token_map.json"
NO_TOKEN_MAP = "none"


def read_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The ids in a token-map file (a JSON list, or a tensor saved by torch), sorted; ValueError names what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"token map {path} does not exist")
    try:
        ids = json.loads(path.read_text()) if path.suffix == ".json" else torch.load(path, weights_only=True)
        ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
    except (ValueError, TypeError, RuntimeError, UnicodeDecodeError) as e:
        raise ValueError(f"token map {path} is not a list of token ids: {e}") from e
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"token map {path} must list token ids in [0, {vocab_size}); it has {ids.numel()} "
                         f"entries" + (f" in [{int(ids.min())}, {int(ids.max())}]" if ids.numel() else ""))
    return ids.unique()       # sorted


def write_token_map(ids: torch.Tensor, folder: Path) -> Path:
    path = folder / TOKEN_MAP_FILE
    path.write_text(json.dumps(sorted(int(i) for i in ids)) + "\n")
    return path


def find_token_map(setting: str | None, folder: Path | None, vocab_size: int) -> torch.Tensor | None:
    """The map a drafter uses: the one named by --speculative-token-map, none for "none", else its folder's."""
    if setting == NO_TOKEN_MAP:
        return None
    if setting is not None:
        return read_token_map(setting, vocab_size)
    if folder is not None and (folder / TOKEN_MAP_FILE).is_file():
        return read_token_map(folder / TOKEN_MAP_FILE, vocab_size)
    return None


class ReducedHead:
    """A head's rows for the mapped tokens only; called on hidden [B, H], it gives logits [B, vocab_size] over
    the target's vocabulary, -inf outside the map."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, vocab_size: int, dtype: torch.dtype,
                 quantization: str | None = None):
        self.vocab_size, self.ids = vocab_size, ids.to(weight.device)
        rows = weight.detach()[self.ids].to(dtype).contiguous()       # [V', H], its own copy
        if rows.is_cpu:       # at a head's precision under --quantization (layers/quantization.py)
            self.linear = inference_linears([(rows, None)], rows.device, dtype,
                                            HEAD_QUANTIZATION.get(quantization, quantization))[0]
        else:
            self.linear = lambda x: F.linear(x, rows)

    @property
    def size(self) -> int:
        return len(self.ids)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.linear(hidden).float()                                           # [B, V']
        full = scores.new_full((hidden.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.ids, scores)
