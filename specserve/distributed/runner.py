"""Rank 0's view of the sharded target: the model and the runner the engine calls, each call broadcast to every
rank and run on rank 0's own shard too."""
from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass

import torch
from torch import nn

from specserve.distributed.group import ParallelGroup, WorkerLostError, start_group
from specserve.distributed.plan import ShardPlan, describe
from specserve.distributed.worker import Shard
from specserve.models.config import ModelConfig
from specserve.runtime.model_runner import ForwardItem

logger = logging.getLogger(__name__)


class ParallelEmbedding(nn.Module):
    """The target's embedding as a drafter sharing it (MTP, EAGLE3) sees it: one call over every rank's rows."""

    def __init__(self, target: ParallelTarget):
        super().__init__()
        self.call = target.execute
        self.embedding_dim = target.config.hidden_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.call("embed", input_ids.cpu())


@dataclass(slots=True)
class TargetParts:
    """What drafters read of `target.model`: the embedding (through the ranks) and the final norm (replicated)."""
    embed_tokens: ParallelEmbedding
    norm: nn.Module
    layers: nn.ModuleList


class ParallelTarget:
    """Stands in for the target model on rank 0: forward, compute_logits (gathered over the vocabulary shards)
    and the embedding run on every rank, through the group."""

    def __init__(self, config, model_config: ModelConfig, device: torch.device):
        N = config.tensor_parallel_size
        ShardPlan.of(model_config, N, 0)                  # the start-up check, before any process starts
        logger.info("%s", describe(model_config, N))
        self.config = model_config
        self.group: ParallelGroup = start_group(config, N, device)
        atexit.register(self.close)
        try:
            self.shard = Shard(config, self.group)
        except BaseException:
            self.close()
            raise
        local = self.shard.model
        # what the architecture's class sets on its config (Qwen3: q/k norms), as loading the whole model would
        model_config.qk_norm, model_config.attention_bias = local.config.qk_norm, local.config.attention_bias
        self.model = TargetParts(ParallelEmbedding(self), local.model.norm, local.model.layers)

    def execute(self, op: str, *args):
        if self.group.lost is not None:
            raise WorkerLostError(self.group.lost)
        try:
            self.group.send(op, args)
            return self.shard.run(op, args)
        except RuntimeError as e:
            # a rank gone (gloo raises a plain RuntimeError when a peer's connection closes; the monitor then
            # has its exit code), or silent past the collective timeout (DistError); else rank 0's own error
            message = self.group.explain(e)
            if self.group.lost is None and not isinstance(e, torch.distributed.DistError):
                raise
            self.group.mark_lost(message)
            raise WorkerLostError(self.group.lost) from e

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx=None, aux_layers: tuple[int, ...] = ()):
        if ctx is not None:
            raise ValueError("paged forwards of a sharded target go through its runner (ParallelRunner)")
        return self.execute("call", input_ids.cpu(), positions.cpu(), aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.execute("logits", hidden.cpu()).to(hidden.device)

    def parameters(self):
        return self.shard.model.parameters()

    def pack(self, device: torch.device, dtype: torch.dtype, quantization: str | None = None,
             compile: bool = False) -> ParallelTarget:
        return self                                        # every rank packed its shard when it loaded it

    def close(self) -> None:
        """Stop the workers and leave the group (a later engine in this process may start another)."""
        self.group.close()


class ParallelRunner:
    """ModelRunner's interface over the ranks: each rank keeps the KV cache of its heads, indexed by the block
    tables rank 0's block manager hands out."""

    def __init__(self, target: ParallelTarget, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu", row_by_row: bool = False,
                 kv_kind: str = "auto"):
        if not row_by_row:
            raise ValueError("a sharded target runs row by row (the target's runner)")
        self.target = target
        target.execute("make_runner", num_blocks, block_size, kv_kind)

    def forward(self, items: list[ForwardItem], aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.target.execute("forward", items, aux_layers)

    def move_kv(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        self.target.execute("move_kv", block_table, src, dst)
