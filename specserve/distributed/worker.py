"""What every rank runs: its shard of the target, one call per command from rank 0; ranks 1..N-1 loop on it."""
from __future__ import annotations

import logging
import os
import threading
import time

import torch

from specserve.distributed.group import ParallelGroup, init_group, rank_device, torchrun_env
from specserve.distributed.plan import ShardPlan
from specserve.distributed.shard import gather_logits, load_shard
from specserve.models.config import ModelConfig
from specserve.runtime.device import keep_freed_memory, resolve_device, resolve_dtype
from specserve.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Shard:
    """One rank's target: the calls rank 0's engine makes, each run on every rank at once (the collectives
    inside them pair up because every rank runs the same calls in the same order)."""

    def __init__(self, config, group: ParallelGroup):
        self.group = group
        self.config = ModelConfig.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, self.config, group.device)
        self.plan = ShardPlan.of(self.config, group.world_size, group.rank)
        if group.device.type == "cpu":        # the cores are shared by the ranks of this machine
            keep_freed_memory()
            torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // group.world_size))
        self.model = load_shard(config.model, self.config, self.plan, self.dtype, group.device, config.quantization)
        self.runner: ModelRunner | None = None

    def run(self, op: str, args: tuple):
        with torch.inference_mode():
            return getattr(self, op)(*args)

    def make_runner(self, num_blocks: int, block_size: int, kv_kind: str = "auto") -> None:
        """The rank's KV cache: its own KV heads, the engine's blocks (the same block tables index every rank's)."""
        c = self.plan.local_config(self.config)
        self.runner = ModelRunner(self.model, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_blocks,
                                  block_size, self.dtype, self.group.device, row_by_row=True, kv_kind=kv_kind)

    def forward(self, items, aux_layers):
        return self.runner.forward(items, aux_layers)

    def move_kv(self, block_table, src, dst) -> None:
        self.runner.move_kv(block_table, src, dst)

    def logits(self, hidden: torch.Tensor):
        return gather_logits(self.model.compute_logits(hidden.to(self.group.device)), self.plan)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids.to(self.group.device))

    def call(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers):
        """A cache-free forward (the EAGLE3 head's start-up check)."""
        dev = self.group.device
        return self.model(input_ids.to(dev), positions.to(dev), None, aux_layers)


def serve_commands(shard: Shard) -> None:
    """Ranks 1..N-1: run rank 0's calls until it says stop. A call that raises here raised on rank 0 too (the same
    code on the same inputs), so the loop goes on in step with it."""
    while True:
        op, args = shard.group.receive()
        if op == "stop":
            return
        try:
            shard.run(op, args)
        except Exception:
            logger.exception("rank %d: %s failed", shard.group.rank, op)


def exit_with_parent(parent_pid: int) -> None:
    def run():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)                 # rank 0 is gone: nobody will send another command
    threading.Thread(target=run, name="specserve-tp-parent", daemon=True).start()


def worker_main(config, rank: int, world_size: int, init_method: str | None, parent_pid: int | None = None) -> None:
    """A worker rank: join the group, load its shard, serve rank 0's calls."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    if parent_pid is not None:
        exit_with_parent(parent_pid)
    local_rank = torchrun_env()[2] if init_method == "env://" else rank
    device = rank_device(resolve_device(config.device), local_rank)
    group = init_group(rank, world_size, device, init_method)
    serve_commands(Shard(config, group))
    group.closed = True
    torch.distributed.destroy_process_group()


def run_torchrun_worker(config) -> bool:
    """In a process torchrun started with a rank above 0: be that worker (True when it has served); else False."""
    env = torchrun_env()
    if env is None or env[0] == 0 or config.tensor_parallel_size == 1:
        return False
    if env[1] != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {env[1]} processes; tensor_parallel_size is {config.tensor_parallel_size}")
    worker_main(config, env[0], env[1], "env://")
    return True

