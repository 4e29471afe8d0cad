"""The local dispatcher (ep = etp = 1): ``dispatch.alltoall.AllToAllDispatcher`` without groups.

Every phase that would exchange (counts, all-to-all, etp gather, reduce-scatter) is a no-op on one rank, so
dispatch permutes the copies into expert-major rows and combine weights and sums them back per token. Nothing
crosses ranks; host synchronisations are counted by tests/dispatch/test_host_sync.py.
"""

from __future__ import annotations

from moefold.dispatch.alltoall import AllToAllDispatcher
from moefold.dispatch.base import PhaseTimer
from moefold.dispatch.config import DispatcherKind


class LocalDispatcher(AllToAllDispatcher):
    """ep = etp = 1: permute into expert-major rows and back, no communication.

    Dropless or padded it never synchronises with the host (N = T*K, or E * capacity, is known);
    unpadded capacity mode reads the kept count once. Its ``tokens_per_expert_host`` is then None
    when dropless: the counts stay on the device (a backend that needs them on the host reads them).
    """

    kind = DispatcherKind.LOCAL
    name = "local"

    def __init__(self, num_experts: int, timer: PhaseTimer | None = None, fp8: bool = False):
        super().__init__(num_experts, None, None, None, timer, fp8=fp8)


__all__ = ["LocalDispatcher"]
