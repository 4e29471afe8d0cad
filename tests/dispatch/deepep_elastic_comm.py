"""DeepEP V2's NCCL communicator handle (``deep_ep/utils/comm.py`` at dd758ca), for the CPU stand-in
(deepep_elastic_standin.py).

The real ``get_nccl_comm_handle(group)`` (comm.py:42-75) does not make a communicator of its own: it takes torch's,
``group._get_backend(cuda)._comm_ptr()``, and caches it per group for the life of the process (comm.py:57-64).
torch's ``ProcessGroupNCCL`` forms its communicator at the group's first collective (or at once when the default
group was initialised with ``device_id``); before, ``_comm_ptr()`` is 0. DeepEP keeps that 0 (a later collective
does not refresh the cache) and hands it to its C++: ``calculate_elastic_buffer_size`` reads the topology through
``ncclTeamWorld(comm)`` (``csrc/kernels/backend/nccl.cu:51``), ``ElasticBuffer`` through
``ncclCommQueryProperties(comm)`` (nccl.cu:84): the process crashes or NCCL fails.

Here a gloo group stands for the NCCL one and its collective count (``_get_sequence_number_for_group``: torch
counts every collective issued on the group, by anyone) for whether its communicator is formed: the handle is 0
for a group that has run none when DeepEP first asks, and stays 0. Only a real collective on that very group makes
it non-zero, so a caller passes exactly when the real library would find the communicator formed. (Eager
formation through ``device_id`` has no gloo counterpart: the stand-in asks for the collective moefold runs anyway.)
With ``EP_REUSE_NCCL_COMM=0`` DeepEP makes its own communicator instead (comm.py:66-75: an ``all_gather_object`` of
its unique id over the group, then ``ncclCommInitRank``), which needs nothing formed: modelled too.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

STORAGE: dict[Any, int] = {}   # comm.py:39 ``_storage``: group -> communicator handle (0: null)
_OWN = 1                       # a communicator DeepEP created itself


def comm_handle(group: dist.ProcessGroup) -> int:
    """comm.py:57-75 ``get_nccl_comm_handle(group).get()``: torch's communicator (0 until the group's first
    collective) cached on first use, or DeepEP's own with ``EP_REUSE_NCCL_COMM=0``."""
    if group in STORAGE:                                                       # comm.py:57-58
        return STORAGE[group]
    if int(os.getenv("EP_REUSE_NCCL_COMM", "1")):                             # comm.py:61-64
        formed = group._get_sequence_number_for_group() > 0
        STORAGE[group] = id(group) if formed else 0
        return STORAGE[group]
    unique_ids: list[Any] = [None] * group.size()                            # comm.py:66-75
    dist.all_gather_object(unique_ids, os.getpid(), group)
    STORAGE[group] = _OWN
    return _OWN


def require_formed(group: dist.ProcessGroup, where: str) -> None:
    """What the C++ does with the handle of ``group``: a null one is where the real library breaks."""
    if comm_handle(group) == 0:
        raise RuntimeError(
            f"{where}: DeepEP reused torch's NCCL communicator of this group (deep_ep/utils/comm.py:61-64, "
            f"_comm_ptr()) before the group had run a collective: it is null, DeepEP cached it, and its C++ "
            f"dereferences it (csrc/kernels/backend/nccl.cu:51 ncclTeamWorld, :84 ncclCommQueryProperties): the "
            f"rank crashes. Run a collective on the group (or init with device_id) before DeepEP's first call")


def reset() -> None:
    STORAGE.clear()
