"""Speculative decoding vs plain decoding, side by side in one run, on the same prompts.

For each method (plain, n-gram, draft model, EAGLE3, MTP: those the model folder offers) and each
num_assistant_tokens, runs code and prose prompts at batch 1 and batch 8 (greedy) and prints output
tokens/s, mean acceptance length and the speedup over plain decoding measured in the same run.

    python benchmarks/bench_spec.py [--model DIR] [--methods none,ngram,draft] [--k 1,3,5] [--batch 1,8]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specserve.config import demo_model_dir
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

CODE = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def __init__(self):\n"]
PROSE = ["ROMEO:\nWhat light through yonder window breaks?\n", "First Citizen:\nBefore we proceed any further, hear me speak.\n"]


def heldout_documents(model_dir: Path) -> dict[str, list[str]]:
    """The demo corpus' held-out documents (never trained on), by kind, from the trainer's heldout.json."""
    from specserve.train.corpus import split_file
    path = model_dir / "heldout.json"
    docs: dict[str, list[str]] = {"code": [], "text": []}
    if not path.exists():
        return docs
    for entry in json.loads(path.read_text()):
        source = Path(entry["path"])
        if not source.exists():
            continue
        for doc in split_file(source, entry["name"].split("#")[0]):
            if doc.chunk == entry.get("chunk"):
                docs["code" if source.suffix == ".py" else "text"].append(doc.text)
    return docs


def heldout_prompts(model_dir: Path, kind: str, count: int, chars: int = 400) -> list[str]:
    """Prompts cut from held-out documents, else built-in ones."""
    prompts = []
    for text in heldout_documents(model_dir)[kind]:
        for start in range(0, max(1, len(text) - chars), len(text) // 3 + 1):
            piece = text[start:start + chars]
            if len(piece) > chars // 2:
                prompts.append(piece)
    return prompts[:count] or (CODE if kind == "code" else PROSE)[:count]


def measure(llm: LLM, prompts: list[str], batch: int, params: SamplingParams) -> dict:
    """Output tokens/s, mean acceptance length (1 + accepted / drafts), per-position acceptance rate and
    output tokens over all prompts, `batch` at a time."""
    tokens, drafts, accepted, elapsed, per_position = 0, 0, 0, 0.0, []
    for i in range(0, len(prompts), batch):
        start = time.perf_counter()
        outs = llm.generate(prompts[i:i + batch], params)
        elapsed += time.perf_counter() - start
        for o in outs:
            tokens += len(o.outputs[0].token_ids)
            drafts += o.spec["num_drafts"]
            accepted += o.spec["num_accepted_tokens"]
            counts = o.spec["accepted_per_position"]
            per_position += [0] * (len(counts) - len(per_position))
            for j, n in enumerate(counts):
                per_position[j] += n
    return {"tokens_per_s": tokens / elapsed, "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "per_position": [n / drafts for n in per_position] if drafts else [], "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(demo_model_dir()))
    ap.add_argument("--methods", default="none,ngram,draft")
    ap.add_argument("--k", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--kinds", default="code,text")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="auto: the engine's choice (bf16 for the bf16 demo checkpoint on CPU)")
    ap.add_argument("--tree", default="", help="EAGLE3 trees as b:depth:k,... e.g. 2:3:8,4:2:8")
    args = ap.parse_args()
    model = Path(args.model)
    methods = args.methods.split(",")
    ks = [int(k) for k in args.k.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    trees = [tuple(int(x) for x in t.split(":")) for t in args.tree.split(",") if t]
    rows = []
    for kind in args.kinds.split(","):
        prompts = heldout_prompts(model, kind, args.prompts)
        for batch in batches:
            base = None
            for method in methods:
                # every setting sees the same prompts: no prefix-cache hits from the previous setting, and no
                # cross-request n-gram cache (it would hold the previous setting's identical outputs)
                llm = LLM(str(model), dtype=args.dtype, speculative_method=method, max_num_seqs=max(batches),
                          enable_prefix_caching=False, ngram_cache=False)
                llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))      # warm-up
                settings = [dict(num_assistant_tokens=0)] if method == "none" else [dict(num_assistant_tokens=k) for k in ks]
                if method == "eagle3":
                    settings += [dict(branching_factor=b, tree_depth=d, num_assistant_tokens=k) for b, d, k in trees]
                for extra in settings:
                    params = SamplingParams.from_dict(dict(temperature=0, max_tokens=args.max_tokens, **extra))
                    m = measure(llm, prompts, batch, params)
                    tps, mal, n = m["tokens_per_s"], m["acceptance_length"], m["tokens"]
                    if method == "none":
                        base = tps
                    label = method if method == "none" else f"{method} " + " ".join(f"{k[:1] if k != 'num_assistant_tokens' else 'k'}={v}" for k, v in extra.items())
                    rows.append((kind, batch, label, tps, mal, tps / base if base else float("nan"), n))
                del llm
    print(f"\ngreedy, {args.max_tokens} new tokens per prompt, {args.prompts} prompts per kind, dtype {args.dtype}, model {model}")
    print("| prompts | batch | method | output tok/s | mean acceptance length | speedup vs plain |")
    print("|---|---|---|---|---|---|")
    for kind, batch, label, tps, mal, speedup, n in rows:
        print(f"| {kind} | {batch} | {label} | {tps:.0f} | {mal:.2f} | {speedup:.2f}x |")


if __name__ == "__main__":
    main()
