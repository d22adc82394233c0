"""The run's process group: torchrun's ranks (or one process as a group of one), each rank's device, the rank's
death with its launcher, and the all-reduce the step loop sums its counts with.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.config import ConfigError


def die_with_launcher() -> None:
    """A rank ends when torchrun does: a `kill -9` of torchrun (an OOM killer, a careless kill) would otherwise leave
    the ranks training on to the end, writing checkpoints into a run dir that a restart is refused. Linux's
    parent-death signal (SIGTERM), set by each rank on itself."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    launcher = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


def init_distributed(device_kind: str) -> tuple[int, int, torch.device]:
    """torchrun sets RANK/WORLD_SIZE; plain `python -m trainer` becomes a one-rank group, so one code path."""
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible")
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(minutes=30))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def all_sum(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    """Each of `values` summed (or reduced by `op`) over all ranks, as floats; the values themselves on one rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()
