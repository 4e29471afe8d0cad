"""Under torchrun, ``moefold train``'s workers join the world before anything else, so that they agree on the run
before it starts: rank 0 claims the run directories (``training.launch.claim``) and hands the outcome to every
rank (``agree``), every rank runs the pre-flight checks on its own node's files and they share the first failure
(``first_error``): one error line, exit 2, on every rank.

The store is the agent's (torchrun shares its rendezvous TCP store with the workers), which outlives a restart
of the group (``--max-restarts``); ``init_process_group``'s keys are the same in every attempt, so a restarted
rank could read an address the previous attempt left and connect to a dead peer (the group hung). Each attempt
therefore gets keys of its own: a prefix counted per rank (every rank of a restarted group starts again, so the
counts agree).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from moefold.parallel.init import init_process_group_on
from moefold.training.config import RunConfig
from moefold.training.launch.ranks import pick_device


def join_torchrun(device: str, timeout: timedelta) -> None:
    """Initialise the default process group of torchrun's world (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` /
    ``MASTER_PORT`` from its environment), under keys of this attempt's own (module docstring); ``device``:
    ``--device`` (NCCL bound to the GPU on CUDA, else gloo: ``parallel.init.init_process_group_on``)."""
    dev = pick_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"   # else rank 0 hosts it (env://)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")), world_size=world,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    attempt = store.add(f"moefold/attempts/rank{rank}", 1)
    init_process_group_on(dev, store=dist.PrefixStore(f"moefold/{attempt}", store), rank=rank, world_size=world,
                          timeout=timeout)


def agree(config: RunConfig, error: str | None) -> tuple[RunConfig, str | None]:
    """Rank 0's (claimed) config and error on every rank when a process group exists; otherwise the arguments."""
    if not dist.is_initialized():
        return config, error
    box = [(config.to_dict(), error)]
    dist.broadcast_object_list(box, src=0)
    d, error = box[0]
    return RunConfig.from_dict(d), error


def first_error(error: str | None) -> str | None:
    """The first rank's error (in rank order) on every rank when a process group exists; otherwise ``error``."""
    if not dist.is_initialized():
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)
