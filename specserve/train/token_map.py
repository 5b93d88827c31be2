"""`specserve train token-map`: the tokens a draft model or MTP layers score (drafting/token_map.py), chosen from
recorded data as the tokens the target predicts most often. `train draft` and `train mtp --data` write one
beside their weights too (--token-map-size; 0 for none)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specserve.drafting.token_map import write_token_map
from specserve.models.config import ModelConfig
from specserve.train.data import Conversations, load_conversations

DEFAULT_TOKEN_MAP_SIZE = 8192


def ranked_tokens(data: Conversations, vocab_size: int) -> list[int]:
    """Every token, the ones the target predicts most often (its argmax) over the recorded conversations first,
    answer positions counted twice; ties broken by how often the token occurs in the text, then by id."""
    top1 = data.topk_ids[:, 0]
    predicted = (torch.bincount(top1, minlength=vocab_size) + torch.bincount(top1[data.trainable], minlength=vocab_size)).tolist()
    occurs = torch.bincount(data.input_ids, minlength=vocab_size).tolist()
    return sorted(range(vocab_size), key=lambda t: (-predicted[t], -occurs[t], t))


def frequent_tokens(data: Conversations, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` best-ranked tokens (ranked_tokens), ascending."""
    return torch.tensor(sorted(ranked_tokens(data, vocab_size)[:size]), dtype=torch.int64)


def answer_coverage(data: Conversations, ids: torch.Tensor, vocab_size: int) -> float:
    """The fraction of answer positions whose target argmax is among `ids`."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    return inside[data.topk_ids[data.trainable, 0].cpu()].float().mean().item()


def write_data_token_map(data: Conversations, size: int, vocab_size: int, folder: Path) -> dict:
    """folder/token_map.json of the data's `size` most predicted tokens; what it covers, for a training summary."""
    if size <= 0:
        return {}
    ids = frequent_tokens(data, min(size, vocab_size), vocab_size)
    write_token_map(ids, folder)
    return {"token_map_size": len(ids), "token_map_coverage_of_answers": answer_coverage(data, ids, vocab_size)}


def add_token_map_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("token-map", help="the token map a draft model or MTP layers draft over, from data",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="conversations recorded by `specserve train data`")
    p.add_argument("--target", type=Path, default=None, help="the target model folder (default: the data's)")
    p.add_argument("--size", type=int, default=DEFAULT_TOKEN_MAP_SIZE, help="tokens in the map")
    p.add_argument("--out", type=Path, required=True, help="the drafter folder to write token_map.json into")
    p.set_defaults(func=run_token_map_command)


def run_token_map_command(args: argparse.Namespace) -> None:
    if args.size < 1:
        raise SystemExit("error: --size must be >= 1")
    if not args.out.is_dir():
        raise SystemExit(f"error: --out {args.out} is not a folder")
    data = load_conversations(args.data)
    target = args.target or Path(json.loads((args.data / "training_summary.json").read_text())["target"])
    vocab_size = ModelConfig.from_pretrained(target).vocab_size
    print(json.dumps(write_data_token_map(data, args.size, vocab_size, args.out), indent=2))
