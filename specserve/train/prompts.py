"""Prompts for self-distillation: math questions, code tasks and questions from the standard library, prose
continuations. Each source is split into training and held-out items before any prompt is built, so a
held-out prompt shares no function, module, passage or question with a training one."""
from __future__ import annotations

import ast
import json
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from specserve.config import data_file

PROMPT_DATA = data_file("train_prompts.jsonl").parent        # the package's data folder
MAX_SOURCE_LINES = 24


@dataclass(slots=True)
class Prompt:
    kind: str              # "math" | "code" | "explain" | "question" | "prose"
    text: str              # the user message
    source: str            # where it comes from (module.function, file:line, question number)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class PromptCounts:
    math: int = 260
    code: int = 120
    explain: int = 70
    question: int = 60
    prose: int = 110


@dataclass(slots=True)
class StdlibFunction:
    module: str
    name: str
    signature: str
    doc: str
    source: str


def stdlib_functions(stdlib: Path | None = None) -> list[StdlibFunction]:
    """Public top-level functions with a docstring from the standard library's top-level .py modules."""
    stdlib = stdlib or Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(stdlib.glob("*.py")):
        if path.name.startswith("_") or path.name.startswith("test"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc.split()) < 4:
                continue
            source = "\n".join(lines[node.lineno - 1:node.end_lineno])
            if len(source.splitlines()) > MAX_SOURCE_LINES:
                continue
            found.append(StdlibFunction(path.stem, node.name, ast.unparse(node.args), doc.strip().split("\n\n")[0],
                                        source))
    return found


def split_items(items: list, heldout_fraction: float, rng: random.Random) -> tuple[list, list]:
    items = list(items)
    rng.shuffle(items)
    n = max(1, round(len(items) * heldout_fraction))
    return items[n:], items[:n]


def code_prompts(functions: list[StdlibFunction], rng: random.Random) -> dict[str, list[Prompt]]:
    by_kind: dict[str, list[Prompt]] = {"code": [], "explain": [], "question": []}
    for f in functions:
        where = f"{f.module}.{f.name}"
        doc = " ".join(f.doc.split())
        by_kind["code"].append(Prompt("code", rng.choice([
            f"Write a Python function `{f.name}({f.signature})`. {doc}",
            f"Implement `def {f.name}({f.signature}):` in Python. Docstring: \"{doc}\"",
            f"Write Python code for a function named {f.name} that does the following: {doc}",
        ]), where))
        by_kind["explain"].append(Prompt("explain", rng.choice([
            "Explain what this Python code does:\n\n```python\n{}\n```",
            "What does this function do? Explain it step by step.\n\n```python\n{}\n```",
        ]).format(f.source), where))
        by_kind["question"].append(Prompt("question", rng.choice([
            f"What does `{f.name}` in Python's `{f.module}` module do?",
            f"In one or two sentences: what is `{f.module}.{f.name}` used for in Python?",
            f"How do I use `{f.module}.{f.name}` in Python? Give a short example.",
        ]), where))
    for kind in by_kind:
        rng.shuffle(by_kind[kind])
    return by_kind


def passages(path: Path, lines_per_passage: tuple[int, int], rng: random.Random) -> list[tuple[int, str]]:
    """Consecutive non-empty lines cut from a text file, as (first line number, text), not overlapping."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        n = rng.randint(*lines_per_passage)
        chunk = [line for line in lines[i:i + n] if line.strip()]
        if len(chunk) >= 3:
            out.append((i + 1, "\n".join(chunk)))
        i += n + rng.randint(0, 40)
    return out


def prose_prompts(data: Path, rng: random.Random, heldout_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """Passages of tinyshakespeare and the sonnets to continue, summarise or rewrite; the held-out ones come
    from the last `heldout_fraction` of each file, so no training passage overlaps them."""
    train, heldout = [], []
    for name in ("tinyshakespeare.txt", "sonnet.txt"):
        path = data / name
        if not path.exists():
            continue
        cut = passages(path, (4, 8), rng)
        boundary = int(len(cut) * (1 - heldout_fraction))
        for index, (line, text) in enumerate(cut):
            template = rng.choice([
                "Continue this text in the same style:\n\n{}",
                "Continue the following passage:\n\n{}",
                "Summarize this passage in plain English:\n\n{}",
                "Write the next few lines of this poem or play:\n\n{}",
            ])
            (train if index < boundary else heldout).append(Prompt("prose", template.format(text), f"{name}:{line}"))
    rng.shuffle(train)
    rng.shuffle(heldout)
    return train, heldout


def math_prompts(data: Path, rng: random.Random, heldout_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    rows = [json.loads(line) for line in (data / "train_prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [Prompt("math", r["prompt"], f"train_prompts.jsonl:{i + 1}") for i, r in enumerate(rows)]
    return split_items(prompts, heldout_fraction, rng)


def build_prompts(counts: PromptCounts, seed: int = 0, data: Path = PROMPT_DATA,
                  heldout_fraction: float = 0.1) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts interleaved across kinds, held-out prompts). Held-out code prompts come from whole
    held-out modules."""
    rng = random.Random(seed)
    functions = stdlib_functions()
    modules = sorted({f.module for f in functions})
    train_modules, heldout_modules = split_items(modules, heldout_fraction, rng)
    heldout_set = set(heldout_modules)
    train_code = code_prompts([f for f in functions if f.module not in heldout_set], rng)
    heldout_code = code_prompts([f for f in functions if f.module in heldout_set], rng)
    train_prose, heldout_prose = prose_prompts(data, rng, heldout_fraction)
    train_math, heldout_math = math_prompts(data, rng, heldout_fraction)
    pools = {"math": train_math, "code": train_code["code"], "explain": train_code["explain"],
             "question": train_code["question"], "prose": train_prose}
    chosen = {kind: pools[kind][:getattr(counts, kind)] for kind in pools}
    train = [p for kind in chosen for p in chosen[kind]]
    rng.shuffle(train)        # a run stopped early still covers every kind
    heldout = heldout_code["code"] + heldout_code["explain"] + heldout_code["question"] + heldout_prose + heldout_math
    return train, heldout


def write_jsonl(path: Path, prompts: list[Prompt]) -> None:
    path.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in prompts))


def read_jsonl(path: Path) -> list[Prompt]:
    return [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
