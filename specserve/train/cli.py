"""`specserve train ...`: `demo` models; `data` (self-distillation), `eagle3`, `draft`, `mtp`, `token-map` for any
target; `ship`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve.models.registry import parse_dtype
from specserve.train.demo import DEFAULT_OUT, DemoConfig, run_demo
from specserve.train.data import add_data_parser
from specserve.train.draft import add_draft_parser
from specserve.train.eagle3 import add_eagle3_parser
from specserve.train.lm import ModelSize
from specserve.train.mtp import add_mtp_parser
from specserve.train.ship import add_ship_parser
from specserve.train.token_map import add_token_map_parser


def add_train_parsers(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    train = subparsers.add_parser("train", help="train models with specserve's own code")
    train_commands = train.add_subparsers(dest="train_command", required=True)
    add_demo_parser(train_commands)
    add_data_parser(train_commands)
    add_draft_parser(train_commands)
    add_eagle3_parser(train_commands)
    add_mtp_parser(train_commands)
    add_token_map_parser(train_commands)
    add_ship_parser(train_commands)
    return train


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = DemoConfig()
    p = subparsers.add_parser("demo", help="train the demo tokenizer, target and distilled draft from scratch",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", type=Path, nargs="+", default=None,
                   help="text files or folders (default: this Python's standard library + tinyshakespeare)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="target folder; the draft goes to OUT/draft")
    p.add_argument("--target-minutes", type=float, default=defaults.target_minutes)
    p.add_argument("--draft-minutes", type=float, default=defaults.draft_minutes)
    p.add_argument("--max-steps", type=int, default=None, help="fixed steps per stage instead of the time budgets")
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    p.add_argument("--hidden-size", type=int, default=defaults.target.hidden_size)
    p.add_argument("--num-layers", type=int, default=defaults.target.num_layers)
    p.add_argument("--num-heads", type=int, default=defaults.target.num_heads)
    p.add_argument("--num-kv-heads", type=int, default=defaults.target.num_kv_heads)
    p.add_argument("--intermediate-size", type=int, default=defaults.target.intermediate_size)
    p.add_argument("--head-dim", type=int, default=defaults.target.head_dim)
    p.add_argument("--draft-hidden-size", type=int, default=defaults.draft.hidden_size)
    p.add_argument("--draft-num-layers", type=int, default=defaults.draft.num_layers)
    p.add_argument("--draft-num-heads", type=int, default=defaults.draft.num_heads)
    p.add_argument("--draft-num-kv-heads", type=int, default=defaults.draft.num_kv_heads)
    p.add_argument("--draft-intermediate-size", type=int, default=defaults.draft.intermediate_size)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--max-corpus-mb", type=float, default=defaults.max_corpus_mb)
    p.add_argument("--dtype", default="bfloat16", help="dtype of the saved weights")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--resume", action="store_true", help="continue from OUT/.ckpt, skipping finished stages")
    p.set_defaults(func=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> None:
    cfg = DemoConfig(
        out=args.out,
        vocab_size=args.vocab_size,
        target=ModelSize(args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, args.intermediate_size, args.head_dim),
        draft=ModelSize(args.draft_hidden_size, args.draft_num_layers, args.draft_num_heads, args.draft_num_kv_heads,
                        args.draft_intermediate_size, args.head_dim),
        target_minutes=args.target_minutes,
        draft_minutes=args.draft_minutes,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        max_corpus_mb=args.max_corpus_mb,
        dtype=parse_dtype(args.dtype),
        seed=args.seed,
        resume=args.resume,
    )
    if args.corpus:
        cfg.sources = args.corpus
    summary = run_demo(cfg)
    print(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specserve")
    add_train_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
