"""Start torch.distributed from torchrun's environment, or run alone without a launcher."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

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


def init_process_group_on(device: torch.device, **kwargs: Any) -> None:
    """``dist.init_process_group`` for ranks that compute on ``device``: NCCL bound to it on CUDA, gloo otherwise
    (``kwargs``: store, rank, world_size, timeout as torch takes them).

    On CUDA the group gets ``device_id=device``: torch forms the NCCL communicator at once instead of at the first
    collective, and sub-groups (``new_group``, the device mesh) are split from it and formed at once as well
    (``torch.distributed.distributed_c10d``: ``eager_connect_single_device``, ``ncclCommSplit``). Libraries that
    reuse torch's communicator need it formed: DeepEP V2 takes ``ProcessGroupNCCL._comm_ptr()``, which is 0 until
    then (``dispatch.deepep_nccl``). gloo takes no ``device_id`` (torch refuses a CPU one).
    """
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"init_process_group_on({device}): a CUDA device needs its index (cuda:LOCAL_RANK)")
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)


def init_distributed(config: ParallelConfig = ParallelConfig(), timeout_s: float = 600.0) -> ParallelDims:
    """Initialise the default process group and build the rank grid.

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) joins the launched world with NCCL on
    CUDA (bound to the device: ``init_process_group_on``) and gloo otherwise. Without a launcher
    it runs as a world of one, with no process group, so nothing needs a free port. Validates the
    layout before any group is created.
    """
    device = default_device()
    world = dist.get_world_size() if dist.is_initialized() else launched_world_size()
    config.resolve(world)  # fail fast, naming the numbers, before creating any group
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        if device.type != "cuda":
            # Connect each gloo group on first use: connecting the full mesh of every subgroup
            # at start-up fails now and then ("connectFullMesh ... closed by peer") on busy hosts.
            os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
        init_process_group_on(device, timeout=timedelta(seconds=timeout_s))
    return ParallelDims.build(config, device_type=device.type)
