"""specserve's cache folder, and files' sha256 digests remembered by size and modification time."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """$SPECSERVE_CACHE_DIR, else $XDG_CACHE_HOME/specserve, else ~/.cache/specserve."""
    if os.environ.get("SPECSERVE_CACHE_DIR"):
        return Path(os.environ["SPECSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve"


def file_sha256(path: str | Path) -> str:
    """The file's sha256, hashed once: later calls reuse it while the file keeps its size and mtime."""
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    index = cache_dir() / "sha256.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    known = {k: v for k, v in known.items() if not k.startswith(f"{path}:")}
    known[key] = digest.hexdigest()
    index.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=index.parent, prefix="sha256.")
    with os.fdopen(fd, "w") as f:
        json.dump(known, f, indent=1)
    os.replace(tmp, index)
    return known[key]
