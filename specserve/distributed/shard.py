"""One rank's shard of the target: loaded from the safetensors slices it needs, run with one all-reduce after
o_proj and after down_proj (rows), the embedding and LM head split by vocabulary."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from specserve.distributed.plan import ShardPlan
from specserve.models.config import ModelConfig
from specserve.models.llama import Linear
from specserve.models.loader import checkpoint_files
from specserve.models.registry import load_model


def all_reduce(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The sum over ranks, in fp32 and the same on every rank, each element summed alone: a row's result never
    depends on the rows beside it. With two ranks the sum a + b commutes, so one all_reduce is exact; with more, a
    ring all-reduce's order depends on the chunking (the row count), so the parts are gathered and summed in rank
    order."""
    work = x.float()
    if world_size == 2:
        dist.all_reduce(work)
    else:
        parts = [torch.empty_like(work) for _ in range(world_size)]
        dist.all_gather(parts, work)
        work = parts[0]
        for p in parts[1:]:
            work = work + p
    return work.to(x.dtype)


def reduced(linear: Linear, world_size: int) -> Linear:
    """A row-parallel product: this rank's partial sum, then the all-reduce."""
    return lambda x: all_reduce(linear(x), world_size)


class VocabShardEmbedding(nn.Module):
    """This rank's rows [start, start + n) of the embedding; other ids look up zeros, and the all-reduce adds
    the one rank's row to zeros (exact)."""

    def __init__(self, weight: nn.Parameter, start: int, world_size: int):
        super().__init__()
        self.weight, self.start, self.world_size = weight, start, world_size
        self.embedding_dim = weight.shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return all_reduce(x, self.world_size)


def heads(r: range, head_dim: int) -> tuple[int, int]:
    return r.start * head_dim, r.stop * head_dim


def take(f, name: str, plan: ShardPlan, head_dim: int) -> torch.Tensor:
    """The rank's part of one checkpoint tensor, read from its slice (never the whole tensor): q/k/v and gate/up
    by output rows, o/down by input columns, embedding and LM head by vocabulary rows; the rest whole."""
    part = f.get_slice(name)
    leaf = name.split(".")[-2]
    rows = {"q_proj": heads(plan.q_heads, head_dim), "k_proj": heads(plan.kv_heads, head_dim),
            "v_proj": heads(plan.kv_heads, head_dim), "gate_proj": (plan.ffn.start, plan.ffn.stop),
            "up_proj": (plan.ffn.start, plan.ffn.stop)}
    cols = {"o_proj": heads(plan.q_heads, head_dim), "down_proj": (plan.ffn.start, plan.ffn.stop)}
    if leaf in rows:
        a, b = rows[leaf]
        return part[a:b]
    if leaf in cols and len(part.get_shape()) == 2:        # (a row-parallel bias is whole: added once, after the sum)
        a, b = cols[leaf]
        return part[:, a:b]
    if leaf in ("embed_tokens", "lm_head"):
        start, stop = plan.vocab.start, min(plan.vocab.stop, plan.vocab_size)
        rows_here = part[start:stop] if start < stop else part[0:0]
        pad = len(plan.vocab) - rows_here.shape[0]
        return F.pad(rows_here, (0, 0, 0, pad)) if pad else rows_here
    return part[:]


def iter_shard(model_dir: str | Path, config: ModelConfig, plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith("model.layers.") and int(name.split(".")[2]) >= config.num_hidden_layers:
                    continue                                 # MTP layers: the MTP drafter's, on rank 0 only
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                yield name, take(f, name, plan, config.head_dim)


def load_shard(model_dir: str | Path, config: ModelConfig, plan: ShardPlan, dtype: torch.dtype,
               device: torch.device, quantization: str | None = None) -> nn.Module:
    """This rank's model: the target's class at the shard's shape, packed for inference, its row-parallel
    products followed by the all-reduce and its embedding by vocabulary."""
    local = plan.local_config(config)
    model = load_model(model_dir, dtype, device, local, weights=iter_shard(model_dir, config, plan))
    model.model.embed_tokens = VocabShardEmbedding(model.model.embed_tokens.weight, plan.vocab.start, plan.world_size)
    model.pack(device, dtype, quantization)
    for layer in model.model.layers:
        for bundle in (layer.frozen.attn, layer.self_attn.frozen):
            bundle.o = reduced(bundle.o, plan.world_size)
        layer.frozen.down = reduced(layer.frozen.down, plan.world_size)
    return model


def gather_logits(local: torch.Tensor, plan: ShardPlan) -> torch.Tensor | None:
    """[n, V / N] on every rank -> [n, V] on rank 0 (None elsewhere)."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(plan.world_size)] if plan.rank == 0 else None
    dist.gather(local, parts, dst=0)
    return torch.cat(parts, dim=-1)[..., :plan.vocab_size] if plan.rank == 0 else None
