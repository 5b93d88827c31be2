"""EAGLE3 chains and trees beside the draft model, n-gram and plain decoding, on held-out prompts.

Greedy, batch 1 (and optionally more), one run: every speedup is against plain decoding measured in
the same run on the same prompts. Prints a markdown table; --json also writes the rows.

    python benchmarks/bench_eagle3.py [--model DIR] [--k 1,...,8] [--trees 2:2:8,4:3:16] [--prompts 6]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specserve.config import demo_model_dir
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import heldout_prompts, run  # noqa: E402

DEFAULT_TREES = "2:2:6," + ",".join(f"{b}:{d}:{k}" for b in (2, 4, 8) for d in (2, 3, 4) for k in (8, 16)
                                    if b * b * (d - 1) + b >= k)


def settings_of(method: str, ks: list[int], trees: list[tuple[int, int, int]]) -> list[dict]:
    if method == "none":
        return [dict(num_assistant_tokens=0)]
    chains = [dict(num_assistant_tokens=k) for k in ks]
    if method != "eagle3":
        return chains
    return chains + [dict(branching_factor=b, tree_depth=d, num_assistant_tokens=k) for b, d, k in trees]


def label_of(method: str, setting: dict) -> str:
    if method == "none":
        return "plain"
    if "tree_depth" in setting:
        return f"{method} tree b={setting['branching_factor']} depth={setting['tree_depth']} k={setting['num_assistant_tokens']}"
    return f"{method} chain k={setting['num_assistant_tokens']}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(demo_model_dir()))
    ap.add_argument("--methods", default="none,ngram,draft,eagle3")
    ap.add_argument("--k", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--trees", default=DEFAULT_TREES, help="b:depth:k,...")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--kinds", default="code,text")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts per kind")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = Path(args.model)
    ks = [int(k) for k in args.k.split(",")]
    trees = [tuple(int(x) for x in t.split(":")) for t in args.trees.split(",") if t]
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for kind in args.kinds.split(","):
        prompts = heldout_prompts(model, kind, args.prompts)
        for batch in batches:
            base = None
            for method in args.methods.split(","):
                llm = LLM(str(model), dtype=args.dtype, speculative_method=method, max_num_seqs=max(batches),
                          enable_prefix_caching=False, ngram_cache=False)
                llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))    # warm-up
                for setting in settings_of(method, ks, trees):
                    params = SamplingParams.from_dict(dict(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, **setting))
                    tps, mal, n = run(llm, prompts, batch, params)
                    base = tps if method == "none" else base
                    row = dict(kind=kind, batch=batch, method=label_of(method, setting), tokens_per_s=tps,
                               mean_acceptance_length=mal, speedup=tps / base if base else float("nan"), tokens=n)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                del llm
    print(f"\ngreedy, {args.max_tokens} new tokens per prompt, {args.prompts} held-out prompts per kind, "
          f"dtype {args.dtype}, model {model}")
    print("| prompts | batch | method | mean acceptance length | output tok/s | speedup vs plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['batch']} | {r['method']} | {r['mean_acceptance_length']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
