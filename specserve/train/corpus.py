"""Training text: documents from files and folders, whole documents held out for validation.

Python files are kept whole; other text files are cut into chunks at blank lines, so a long text
(tinyshakespeare) can contribute held-out chunks too.
"""
from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from specserve.config import data_file

# stdlib folders that are test suites, tool GUIs, codec tables or data, not code worth learning
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst"}
CHUNK_CHARS = 16_000


@dataclass(slots=True)
class Document:
    name: str               # source-relative path, "#i" appended for a chunk of a text file
    text: str
    path: str               # the file it comes from
    chunk: int | None = None


@dataclass(slots=True)
class Corpus:
    train: list[Document]
    heldout: list[Document]


def default_sources() -> list[Path]:
    """The running interpreter's standard library plus tinyshakespeare (shipped in the package)."""
    return [Path(sysconfig.get_paths()["stdlib"]), data_file("tinyshakespeare.txt")]


def read_source(source: Path) -> list[Document]:
    """All documents of one file or folder, in sorted path order."""
    if source.is_file():
        return split_file(source, source.name)
    docs = []
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if path.suffix not in TEXT_SUFFIXES or not path.is_file() or path.name.startswith("test_"):
            continue
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        docs.extend(split_file(path, f"{source.name}/{rel.as_posix()}"))
    return docs


def split_file(path: Path, name: str) -> list[Document]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".py" or len(text) <= CHUNK_CHARS:
        return [Document(name, text, str(path))] if text.strip() else []
    chunks, current, size = [], [], 0
    for paragraph in text.split("\n\n"):
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= CHUNK_CHARS:
            chunks.append("\n\n".join(current))
            current, size = [], 0
    if current:
        chunks.append("\n\n".join(current))
    return [Document(f"{name}#{i}", chunk, str(path), i) for i, chunk in enumerate(chunks) if chunk.strip()]


def build_corpus(sources: list[Path], heldout_fraction: float, max_bytes: int, seed: int) -> Corpus:
    """Holds out a seeded `heldout_fraction` of each source's documents (at least one where a source has two),
    then caps the training set at `max_bytes`, keeping a seeded random subset of whole documents."""
    rng = random.Random(seed)
    train, heldout = [], []
    for source in sources:
        docs = read_source(Path(source))
        if not docs:
            raise ValueError(f"no text documents found in {source}")
        rng.shuffle(docs)
        num_heldout = max(1, round(len(docs) * heldout_fraction)) if len(docs) >= 2 else 0
        heldout.extend(docs[:num_heldout])
        train.extend(docs[num_heldout:])
    rng.shuffle(train)
    kept, size = [], 0
    for doc in train:
        if size + len(doc.text) > max_bytes and kept:
            continue
        kept.append(doc)
        size += len(doc.text)
    return Corpus(train=kept, heldout=heldout)


def chat_examples(docs: list[Document], num_examples: int, seed: int) -> list[list[dict[str, str]]]:
    """Conversations in which the user gives a few lines and the assistant continues them, so that the
    model learns the ChatML turn structure and ends its turn with <|im_end|>."""
    rng = random.Random(seed)
    conversations = []
    while len(conversations) < num_examples:
        lines = rng.choice(docs).text.splitlines()
        if len(lines) < 6:
            continue
        num_prompt, num_reply = rng.randint(1, 8), rng.randint(2, 20)
        start = rng.randrange(0, max(1, len(lines) - num_prompt - num_reply))
        prompt = "\n".join(lines[start:start + num_prompt]).strip("\n")
        reply = "\n".join(lines[start + num_prompt:start + num_prompt + num_reply]).strip("\n")
        if prompt.strip() and reply.strip():
            conversations.append([{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}])
    return conversations
