"""Starting the ranks of a run: under torchrun (env://), as ``nproc`` local spawned gloo ranks, or alone.

- torchrun / SLURM+torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set): join the launcher's world
  (NCCL on CUDA, gloo on CPU); ``LOCAL_RANK`` picks the GPU.
- ``nproc > 1`` without a launcher: spawn ``nproc`` processes on this machine joined through a
  FileStore in a fresh temporary directory (gloo, CPU, or NCCL with one GPU each when available).
- ``nproc == 1``: run in this process without torch.distributed (world 1, every group None).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moefold.parallel.init import launched_by_torchrun


def pick_device(device: str, local_rank: int) -> torch.device:
    """``auto``: the local GPU when CUDA is available, else CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if device != "cpu":
        raise ValueError(f"--device={device!r}; valid: auto, cpu, cuda")
    return torch.device("cpu")


def _spawned(local_rank: int, fn: Callable[..., Any], nproc: int, store_path: str, device: str,
             timeout_s: float, args: tuple) -> None:
    # Lazy gloo connections: connecting every subgroup's full mesh eagerly, many ranks on few cores,
    # fails now and then with "connectFullMesh ... closed by peer" (see tests/distributed.py).
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(local_rank),
                      TORCH_GLOO_LAZY_INIT="1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    dev = pick_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    store = dist.FileStore(store_path, nproc)
    dist.init_process_group(backend, store=store, rank=local_rank, world_size=nproc,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(dev, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], nproc: int, device: str = "auto", timeout_s: float = 1800.0,
              args: tuple = ()) -> None:
    """Run ``fn(device, *args)`` on every rank of the world chosen as the module docstring says.

    ``fn`` must be importable by name (spawned processes unpickle it). A failing rank raises here.
    """
    if launched_by_torchrun():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        dev = pick_device(device, local_rank)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
        try:
            fn(dev, *args)
        finally:
            dist.destroy_process_group()
        return
    if nproc <= 1:
        fn(pick_device(device, 0), *args)
        return
    with tempfile.TemporaryDirectory(prefix="moefold-launch-") as tmp:
        mp.start_processes(_spawned, args=(fn, nproc, os.path.join(tmp, "store"), device, timeout_s, args),
                           nprocs=nproc, join=True, start_method="spawn")
