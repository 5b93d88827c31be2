"""The default model's shipped drafters (EAGLE3 chain and tree, draft model, MTP) beside plain decoding.

Held-out prompts (never used in training: specserve/default_drafters/heldout_prompts.jsonl, written by
`specserve train data`), chat template, batch 1. For every method: mean acceptance length and output tok/s
at k = 1..8 (greedy), EAGLE3 trees, and sampled rows (temperature 0.7). The engine runs one thread and
throughput is counted in this process's CPU time, because the two cores are shared with other jobs and wall
time drifts with their load (wall-clock figures are printed too); plain decoding is measured again before each
method's rows, and each speedup is against the plain run just before it. Prints a markdown table; --json writes the rows.

    python benchmarks/bench_drafters.py [--k 1,...,8,auto] [--trees 2:3:8,...] [--per-kind 2] [--max-tokens 64]
        [--quantization int4] [--compile] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.drafting.factory import default_drafters_dir
from specserve.train.prompts import read_jsonl

KIND_GROUPS = {"code": ("code", "explain"), "prose": ("prose",), "math": ("math",), "question": ("question",)}


def heldout_conversations(path: Path, groups: list[str], per_kind: int) -> list[tuple[str, list[dict]]]:
    prompts = read_jsonl(path)
    chosen = []
    for group in groups:
        kinds = KIND_GROUPS[group]
        by_kind = [[p for p in prompts if p.kind == k] for k in kinds]
        alternating = [p for row in zip(*by_kind) for p in row]        # code tasks and explanations in turn
        chosen += [(group, [{"role": "user", "content": p.text}]) for p in alternating[:per_kind]]
    return chosen


def measure(llm: LLM, conversations: list[tuple[str, list[dict]]], params: SamplingParams) -> dict:
    """Output tokens per second of whole requests (prefill included), by the wall clock and by this process's
    CPU time. The engine runs one thread, so CPU time is the work done and does not grow while other jobs
    hold the shared cores; speedups are taken from it."""
    tokens, drafts, accepted, wall, cpu, lengths = 0, 0, 0, 0.0, 0.0, []
    for _, messages in conversations:
        start, start_cpu = time.perf_counter(), time.process_time()
        [out] = llm.chat(messages, params)
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        tokens += len(out.outputs[0].token_ids)
        drafts += out.spec["num_drafts"]
        accepted += out.spec["num_accepted_tokens"]
        lengths += out.spec.get("draft_lengths", [])
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": tokens / cpu,
            "wall_tokens_per_s": tokens / wall, "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "mean_draft_length": sum(lengths) / len(lengths) if lengths else 0.0}


def settings_of(method: str, ks: list[int | str], trees: list[tuple[int, int, int]], sampled_k: int) -> list[dict]:
    rows = [dict(num_assistant_tokens=k) for k in ks]
    if method == "eagle3":
        rows += [dict(branching_factor=b, tree_depth=d, num_assistant_tokens=k) for b, d, k in trees]
    rows.append(dict(num_assistant_tokens=sampled_k, temperature=0.7))
    return rows


def label_of(method: str, setting: dict) -> str:
    temp = f" T={setting['temperature']}" if setting.get("temperature") else ""
    if "tree_depth" in setting:
        return f"{method} tree b={setting['branching_factor']} d={setting['tree_depth']} k={setting['num_assistant_tokens']}{temp}"
    return f"{method} k={setting['num_assistant_tokens']}{temp}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", type=Path, default=default_drafters_dir())
    ap.add_argument("--prompts", type=Path, default=None, help="held-out prompts (default: DRAFTERS/heldout_prompts.jsonl)")
    ap.add_argument("--methods", default="eagle3,draft,mtp,ngram", help="ngram: prompt lookup, for comparison")
    ap.add_argument("--k", default="1,2,3,4,5,6,7,8,auto", help="fixed draft lengths, and auto (the policy's choice)")
    ap.add_argument("--trees", default="2:3:8,4:2:8,2:4:8,4:3:16", help="b:depth:k,...")
    ap.add_argument("--groups", default="code,prose,math")
    ap.add_argument("--per-kind", type=int, default=2, help="held-out prompts per group")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sampled-k", type=int, default=5, help="k of the temperature-0.7 row")
    ap.add_argument("--quantization", choices=["int8", "int4"], default=None, help="the target's, which the drafters take too")
    ap.add_argument("--compile", action="store_true", help="the target's forward as torch.compile graphs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    engine = dict(num_threads=args.threads, quantization=args.quantization, compile=args.compile)
    ks = [k if k == "auto" else int(k) for k in args.k.split(",")]
    trees = [tuple(int(x) for x in t.split(":")) for t in args.trees.split(",") if t]
    conversations = heldout_conversations(args.prompts or args.drafters / "heldout_prompts.jsonl",
                                          args.groups.split(","), args.per_kind)
    plain_llm = LLM(speculative_method="none", **engine)
    rows = []

    def plain() -> dict:
        r = measure(plain_llm, conversations, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        rows.append(dict(method="plain", **r, speedup=1.0))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        return r

    measure(plain_llm, conversations[:1], SamplingParams(temperature=0, max_tokens=8))     # warm-up
    for method in args.methods.split(","):
        folder = None if method == "ngram" else str(args.drafters / method)
        llm = LLM(speculative_method=method, draft_model=folder, ngram_cache=False, **engine)
        measure(llm, conversations[:1], SamplingParams(temperature=0, max_tokens=8))
        base = plain()
        for setting in settings_of(method, ks, trees, args.sampled_k):
            params = SamplingParams.from_dict({"temperature": 0, "seed": 0, **setting, "max_tokens": args.max_tokens})
            r = measure(llm, conversations, params)
            rows.append(dict(method=label_of(method, setting), **r, speedup=r["tokens_per_s"] / base["tokens_per_s"]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del llm
    print(f"\nbatch 1, chat template, {len(conversations)} held-out prompts ({args.groups}), up to {args.max_tokens} "
          f"new tokens each, greedy unless T=0.7, {args.threads} engine thread(s), target quantization "
          f"{args.quantization or 'none'}{' --compile' if args.compile else ''}; tok/s per CPU-second (wall-clock tok/s beside "
          f"it); speedup against the plain row above it, in CPU time")
    print("| method | mean acceptance length | mean draft length | output tok/s (CPU time) | wall tok/s | speedup vs plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['acceptance_length']:.2f} | {r['mean_draft_length']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['wall_tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
