"""Data folders of `specserve train data` (one per process that answered a slice of the prompts) merged into
one folder that the trainers read: shards renumbered (moved) after the ones OUT_DIR has, summaries combined.

    python scripts/merge_data.py OUT_DIR DATA_DIR...
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from specserve.train.data import shard_path, shard_totals


def merge(out: Path, sources: list[Path]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    existing = out / "training_summary.json"       # shards already in OUT_DIR stay, the others follow them
    merged: dict = json.loads(existing.read_text()) if existing.exists() else \
        {"shards": {}, "generate_seconds": 0.0, "record_seconds": 0.0}
    merged.setdefault("merged_from", [])
    for src in sources:
        path = src / "training_summary.json"
        if not path.exists():
            continue
        summary = json.loads(path.read_text())
        for index in sorted(summary["shards"], key=int):
            new = len(merged["shards"])
            os.replace(shard_path(src, int(index)), shard_path(out, new))
            merged["shards"][str(new)] = summary["shards"][index]
        merged["generate_seconds"] += summary["generate_seconds"]
        merged["record_seconds"] += summary["record_seconds"]
        merged["merged_from"].append({"dir": str(src), "shards": len(summary["shards"])})
        for key, value in summary.items():
            if key not in merged and key not in ("shards", "num_prompts", "tokens", "answer_tokens", "minutes"):
                merged[key] = value
    merged |= shard_totals(merged)
    (out / "training_summary.json").write_text(json.dumps(merged, indent=2) + "\n")
    return {k: merged[k] for k in ("num_prompts", "tokens", "answer_tokens")} | {"shards": len(merged["shards"])}


if __name__ == "__main__":
    print(json.dumps(merge(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])))
