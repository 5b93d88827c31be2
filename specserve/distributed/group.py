"""The process group: N ranks, gloo on CPU and NCCL on CUDA, started by rank 0 (spawned workers on one machine)
or by torchrun (any number of nodes); a monitor that notices a worker's death."""
from __future__ import annotations

import base64
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# a collective (inside a step) waits this long for the other ranks before the group counts as lost
COLLECTIVE_TIMEOUT_S = float(os.environ.get("SPECSERVE_TP_TIMEOUT_S", "60"))
IDLE_TIMEOUT = timedelta(days=365)            # a worker waits this long for rank 0's next command


class WorkerLostError(BaseException):
    """A tensor-parallel rank died or stopped answering: the engine cannot run another step. A BaseException, so
    that no step's error isolation (LLMEngine.fail_step) takes it for one request's failure."""


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


@dataclass(slots=True)
class ParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    control: dist.ProcessGroup                  # gloo, no timeout: each step's command, pickled
    processes: list[subprocess.Popen] = field(default_factory=list)   # rank 0's workers (none under torchrun)
    lost: str | None = None
    on_lost: list[Callable[[str], None]] = field(default_factory=list)
    closed: bool = False

    def send(self, op: str, args: tuple) -> None:
        """Rank 0: the next call, for every rank to run on its shard."""
        payload = torch.frombuffer(bytearray(pickle.dumps((op, args))), dtype=torch.uint8)
        dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), 0, group=self.control)
        dist.broadcast(payload, 0, group=self.control)

    def receive(self) -> tuple[str, tuple]:
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, 0, group=self.control)
        return pickle.loads(payload.numpy().tobytes())

    def mark_lost(self, message: str) -> None:
        if self.lost is None and not self.closed:
            self.lost = message
            logger.critical("%s", message)
            for listener in self.on_lost:
                listener(message)

    def explain(self, error: BaseException) -> str:
        """Why a collective failed: the monitor's finding when it has one (it sees a worker's exit within 0.1 s)."""
        deadline = time.monotonic() + 1.0
        while self.lost is None and self.processes and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.lost or f"a collective with the tensor-parallel ranks failed ({type(error).__name__}: {error})"

    def watch(self) -> None:
        """Rank 0: a daemon thread that marks the group lost when a spawned worker exits."""
        def run():
            while not self.closed and self.lost is None:
                for r, p in enumerate(self.processes, start=1):
                    if p.poll() is not None:
                        self.mark_lost(f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code {p.returncode}; "
                                       f"the engine cannot continue")
                        return
                time.sleep(0.1)
        threading.Thread(target=run, name="specserve-tp-monitor", daemon=True).start()

    def close(self) -> None:
        if self.closed:
            return
        if self.rank == 0 and self.lost is None:
            try:
                self.send("stop", ())
            except Exception:                       # a worker gone meanwhile: nothing to stop
                pass
        self.closed = True
        for p in self.processes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, device: torch.device, init_method: str | None) -> ParallelGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelGroup(rank, world_size, device, control)


def start_group(config, world_size: int, device: torch.device) -> ParallelGroup:
    """Rank 0's side: under torchrun join the group it set up; else spawn ranks 1..N-1 on this machine."""
    env = torchrun_env()
    if env is not None:
        rank, size, local_rank = env
        if size != world_size or rank != 0:
            raise ValueError(f"torchrun started {size} processes (this one rank {rank}); "
                             f"tensor_parallel_size is {world_size}")
        return init_group(0, size, rank_device(device, local_rank), "env://")
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    # fresh interpreters (not multiprocessing's spawn, which re-runs the caller's __main__ without a guard)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    blob = base64.b64encode(pickle.dumps(config)).decode()
    processes = [subprocess.Popen([sys.executable, "-m", "specserve.distributed", str(r), str(world_size),
                                   init_method, str(os.getpid()), blob]) for r in range(1, world_size)]
    group = init_group(0, world_size, rank_device(device, 0), init_method)
    group.processes = processes
    group.watch()
    return group
