"""Tensor parallelism over torch.distributed: the target sharded Megatron-style over N processes.

Rank 0 runs the engine as on one device (scheduler, block manager, sampler, verification, drafting); each
target call it makes (a forward, logits, an embedding lookup, a KV move) is a command broadcast to ranks
1..N-1, which run the same call on their shard (worker.py). plan.py: which heads, FFN columns and vocabulary
rows each rank holds; shard.py: loading only those rows from the safetensors slices, and the collectives;
group.py: the process group, spawned workers and their monitor; runner.py: rank 0's facade.
"""
