"""MTP drafting beside the other drafters, on the demo corpus' held-out prompts, in one run.

For each method and num_assistant_tokens: output tokens/s, mean acceptance length (1 + accepted / drafts),
speedup over plain decoding measured in the same run, and the acceptance rate at each draft position
(how often the j-th draft token was accepted), which shows MTP's fall past its N trained layers.

    python benchmarks/bench_mtp.py [--model DIR] [--methods none,ngram,draft,eagle3,mtp] [--k 1,2,3,4,5,6]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench_spec import heldout_prompts, measure

from specserve.config import demo_model_dir
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(demo_model_dir()))
    ap.add_argument("--methods", default="none,ngram,draft,eagle3,mtp")
    ap.add_argument("--k", default="1,2,3,4,5,6")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kinds", default="code,text")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    model = Path(args.model)
    ks = [int(k) for k in args.k.split(",")]
    rows = []
    for kind in args.kinds.split(","):
        prompts = heldout_prompts(model, kind, args.prompts)
        base = None
        for method in args.methods.split(","):
            try:
                llm = LLM(str(model), dtype=args.dtype, speculative_method=method, max_num_seqs=max(args.batch, 1),
                          enable_prefix_caching=False, ngram_cache=False)   # settings must not help each other
            except ValueError as e:      # a drafter this model folder does not have
                print(f"skipping {method}: {e}")
                continue
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))          # warm-up
            for k in [0] if method == "none" else ks:
                params = SamplingParams(temperature=args.temperature, seed=0, max_tokens=args.max_tokens,
                                        ignore_eos=True, num_assistant_tokens=k)
                m = measure(llm, prompts, args.batch, params)
                base = m["tokens_per_s"] if method == "none" else base
                rows.append((kind, method, k, m, m["tokens_per_s"] / base if base else float("nan")))
            del llm
    print(f"\ntemperature {args.temperature}, batch {args.batch}, {args.max_tokens} new tokens per prompt, "
          f"{args.prompts} held-out prompts per kind, dtype {args.dtype}, model {model}")
    print("| prompts | method | k | output tok/s | mean acceptance length | speedup vs plain | accepted at draft position 1..k |")
    print("|---|---|---|---|---|---|---|")
    for kind, method, k, m, speedup in rows:
        positions = " ".join(f"{r:.2f}" for r in m["per_position"])
        print(f"| {kind} | {method} | {k or '-'} | {m['tokens_per_s']:.0f} | {m['acceptance_length']:.2f} | "
              f"{speedup:.2f}x | {positions} |")


if __name__ == "__main__":
    main()
