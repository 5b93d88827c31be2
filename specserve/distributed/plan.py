"""Which part of the target each rank holds: whole KV heads with their query heads, FFN columns, vocabulary rows."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specserve.models.config import ModelConfig


def balanced(n: int, parts: int, index: int) -> range:
    """The index-th of `parts` contiguous ranges covering range(n), sizes differing by at most one."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True, slots=True)
class ShardPlan:
    rank: int
    world_size: int
    q_heads: range                # query heads of this rank
    kv_heads: range               # KV heads of this rank (one, replicated, when there are fewer than ranks)
    ffn: range                    # intermediate columns of gate/up, rows of down
    vocab: range                  # embedding / LM-head rows; every rank has len(vocab) rows (the last zero-padded)
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, world_size: int, rank: int) -> ShardPlan:
        """Megatron-style: each rank gets whole KV heads and the query heads that read them. KV heads are split
        (unevenly when N does not divide them), or each replicated over N / Hkv ranks when there are fewer."""
        Hq, Hkv, N = config.num_attention_heads, config.num_key_value_heads, world_size
        group = Hq // Hkv
        if Hkv >= N:
            kv = balanced(Hkv, N, rank)
            q = range(kv.start * group, kv.stop * group)
        elif N % Hkv == 0 and Hq % N == 0:
            kv = range(rank // (N // Hkv), rank // (N // Hkv) + 1)
            q = range(rank * (Hq // N), (rank + 1) * (Hq // N))
        else:
            raise ValueError(f"tensor_parallel_size={N} cannot shard {Hq} query / {Hkv} KV heads: with fewer KV heads "
                             f"than ranks, N must be a multiple of the KV heads and divide the query heads")
        if config.intermediate_size < N:
            raise ValueError(f"tensor_parallel_size={N} exceeds the intermediate size {config.intermediate_size}")
        rows = -(-config.vocab_size // N)
        return cls(rank, N, q, kv, balanced(config.intermediate_size, N, rank),
                   range(rank * rows, (rank + 1) * rows), config.vocab_size)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's shard: a model of this shape holds exactly the rank's rows."""
        return dataclasses.replace(config, num_attention_heads=len(self.q_heads), num_key_value_heads=len(self.kv_heads),
                                   intermediate_size=len(self.ffn), vocab_size=len(self.vocab))


def describe(config: ModelConfig, world_size: int) -> str:
    """What the start-up check found, for the log: each rank's heads, and whether KV heads are replicated."""
    Hq, Hkv, N = config.num_attention_heads, config.num_key_value_heads, world_size
    plans = [ShardPlan.of(config, N, r) for r in range(N)]
    span = lambda r: f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"   # noqa: E731
    ranks = "; ".join(f"rank {p.rank}: KV {span(p.kv_heads)}, q {span(p.q_heads)}, ffn {len(p.ffn)}" for p in plans)
    how = ("KV heads split evenly" if Hkv % N == 0 else
           f"KV heads replicated {N // Hkv}x" if Hkv < N else f"KV heads split unevenly ({N} does not divide {Hkv})")
    return (f"tensor parallel over {N} ranks: {Hq} query / {Hkv} KV heads, {how}; vocabulary {config.vocab_size} in "
            f"{N} shards of {len(plans[0].vocab)}; {ranks}")
