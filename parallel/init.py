"""Start torch.distributed from torchrun's environment, or run alone without a launcher."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from moefold.parallel.dims import ParallelConfig, ParallelDims


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def launched_by_torchrun() -> bool:
    """True under torchrun (or any launcher that sets RANK, WORLD_SIZE and MASTER_ADDR)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def launched_world_size() -> int:
    """The launcher's WORLD_SIZE, or 1 when not launched."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def init_distributed(config: ParallelConfig = ParallelConfig(), timeout_s: float = 600.0) -> ParallelDims:
    """Initialise the default process group and build the rank grid.

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) joins the launched world with NCCL on
    CUDA and gloo otherwise. Without a launcher it runs as a world of one, with no process
    group, so nothing needs a free port. Validates the layout before any group is created.
    """
    device = default_device()
    world = dist.get_world_size() if dist.is_initialized() else launched_world_size()
    config.resolve(world)  # fail fast, naming the numbers, before creating any group
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "gloo":
            # Connect each gloo group on first use: connecting the full mesh of every subgroup
            # at start-up fails now and then ("connectFullMesh ... closed by peer") on busy hosts.
            os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return ParallelDims.build(config, device_type=device.type)
