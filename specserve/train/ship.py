"""`specserve train ship`: trained drafters copied into the package beside the default model.

Each drafter folder keeps its own config.json (the kind is detected from it, as for any drafter folder),
with the sha256 of the GGUF file it was trained for added under TARGET_GGUF_KEY, so that
drafting/factory.py offers it for that model only. The held-out prompts the benchmark reads go with them.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from specserve.drafting.factory import TARGET_GGUF_KEY, default_drafters_dir, drafter_kind

# no tokenizer files: a drafter shares the target's (a draft model's 2 MB tokenizer.json would be a copy of it)
SHIPPED_FILES = ("config.json", "model.safetensors", "generation_config.json", "training_summary.json", "token_map.json")


def ship(drafters: list[Path], data: Path | None, gguf_sha256: str, dest: Path, machine: str) -> dict[str, int]:
    """Copies each drafter to dest/<kind>; returns the bytes of weights shipped per kind."""
    sizes = {}
    dest.mkdir(parents=True, exist_ok=True)
    for src in drafters:
        kind = drafter_kind(src)
        out = dest / kind
        if out.exists():
            shutil.rmtree(out)
        out.mkdir()
        for name in SHIPPED_FILES:
            if (src / name).exists():
                shutil.copyfile(src / name, out / name)
        config = json.loads((out / "config.json").read_text())
        config[TARGET_GGUF_KEY] = [gguf_sha256]
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if (out / "training_summary.json").exists():
            summary = json.loads((out / "training_summary.json").read_text())
            summary["trained_on"] = machine
            (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        sizes[kind] = (out / "model.safetensors").stat().st_size
    if data is not None:
        shutil.copyfile(data / "heldout.jsonl", dest / "heldout_prompts.jsonl")
        shutil.copyfile(data / "training_summary.json", dest / "data_summary.json")
    return sizes


def add_ship_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ship", help="copy trained drafters into the package for the default model")
    p.add_argument("drafters", type=Path, nargs="+", help="drafter folders (EAGLE3 head, draft model, MTP layers)")
    p.add_argument("--data", type=Path, default=None, help="the data folder: its held-out prompts ship too")
    p.add_argument("--dest", type=Path, default=default_drafters_dir())
    p.add_argument("--machine", default="", help="what trained them, recorded in each training_summary.json")
    p.set_defaults(func=run_ship_command)


def run_ship_command(args: argparse.Namespace) -> None:
    from specserve.config import DEFAULT_MODEL_SHA256
    sizes = ship(args.drafters, args.data, DEFAULT_MODEL_SHA256, args.dest, args.machine)
    print(json.dumps({"shipped_bytes": sizes, "total_mb": sum(sizes.values()) / 1e6}, indent=2))
