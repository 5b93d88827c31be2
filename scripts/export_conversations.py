"""The token ids of a `specserve train data` folder in one small file (no hidden states): what the target
answered, for the record and for re-recording states elsewhere.

    python scripts/export_conversations.py DATA_DIR OUT.safetensors
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specserve.train.data import shard_path

NAMES = ("input_ids", "lengths", "num_prompt_tokens", "temperature")


def export(data: Path, out: Path) -> dict:
    summary = json.loads((data / "training_summary.json").read_text())
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in NAMES}
    kinds: list[str] = []
    for index in sorted(int(i) for i in summary["shards"]):
        with safe_open(str(shard_path(data, index)), "pt") as f:
            for name in NAMES:
                parts[name].append(f.get_tensor(name))
            kinds += json.loads(f.metadata()["specserve.state"])["kinds"]
    tensors = {name: torch.cat(parts[name]) for name in NAMES}
    save_file(tensors, str(out), metadata={"kinds": json.dumps(kinds), "summary": json.dumps(summary)})
    return {"conversations": len(kinds), "tokens": int(tensors["input_ids"].numel())}


if __name__ == "__main__":
    print(json.dumps(export(Path(sys.argv[1]), Path(sys.argv[2]))))
