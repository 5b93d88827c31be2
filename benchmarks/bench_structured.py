"""JSON-schema output with and without speculation, side by side in one run, on the default model.

For plain decoding and each method (n-gram, EAGLE3, the draft model) at a fixed k and at "auto": chat prompts
that ask for a JSON record, generated free and under the schema (llguidance). Prints output tokens/s, mean
acceptance length and the ratio to plain decoding in the same mode: drafts cut at the grammar should keep
acceptance up, and the grammar mask should cost little.

    python benchmarks/bench_structured.py [--methods none,ngram,eagle3,draft] [--k 4] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import time

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.structured_output import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
                         "maximum": 120}, "city": {"type": "string", "maxLength": 40},
                         "hobbies": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 30}}}}
TOPICS = ["a retired teacher from Lyon", "a young chess player", "a fisherman in Norway", "a software engineer",
          "a baker who loves music", "a marathon runner"]


def conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe {t} as a JSON object with the fields name, age, city and "
              f"hobbies (a list of strings). Reply with the JSON only."}] for t in TOPICS]


def measure(llm: LLM, convs, params: SamplingParams) -> tuple[float, float]:
    llm.chat(convs[:1], params)                                   # warm-up
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = sum(o.spec["num_drafts"] for o in outs)
    accepted = sum(o.spec["num_accepted_tokens"] for o in outs)
    return tokens / elapsed, (1 + accepted / drafts) if drafts else 1.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="none,ngram,eagle3,draft")
    ap.add_argument("--k", default="4,auto")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    convs = conversations()
    rows, base = [], {}
    for method in args.methods.split(","):
        llm = LLM(speculative_method=method)
        for k in (["0"] if method == "none" else args.k.split(",")):
            for mode in ("free", "schema"):
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                        num_assistant_tokens=k if k == "auto" else int(k),
                                        structured=StructuredOutput(json=SCHEMA) if mode == "schema" else None)
                tps, accept = measure(llm, convs, params)
                if method == "none":
                    base[mode] = tps
                rows.append((method, k, mode, tps, accept, tps / base[mode]))
                print(f"{method} k={k} {mode}: {tps:.1f} tok/s, acceptance length {accept:.2f}", flush=True)
    print("\n| method | k | output | tok/s | acceptance length | vs plain (same output mode) |")
    print("|---|---|---|---|---|---|")
    for method, k, mode, tps, accept, ratio in rows:
        print(f"| {method} | {k} | {mode} | {tps:.1f} | {accept:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
