"""The linear chooser's cache: which kernel each weight shape takes on this machine, kept in a JSON file per user
(layers/linear.py chooses, this file remembers)."""
from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_cache_path() -> Path | None:
    """$SPECSERVE_KERNEL_CACHE (empty: no cache), else the user cache dir's specserve/kernels.json."""
    env = os.environ.get("SPECSERVE_KERNEL_CACHE")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specserve" / "kernels.json"


def machine_key() -> str:
    return (f"{cpu_name()} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads")


def load_cache(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_cache(path: Path | None, cache: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not write the kernel cache %s: %s", path, e)
