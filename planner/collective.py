"""One collective call of a planned layout (``Collective``) and what it moves over one rank's link.

A ``Collective`` is one call a rank makes: its group (a name of ``GROUP_DIMS``), the operation, the bytes and
when it runs (``forward``/``backward`` of one micro-batch, or once per ``step``), and the ``region`` of the code
that issues it (which decides whether recompute repeats it and what it can overlap). ``bytes`` is the size of
the whole buffer, the convention of NCCL's bus bandwidth: the all-gather's *output*, the reduce-scatter's
*input*, the all-reduce's tensor, the all-to-all's *send* buffer (rows a rank sends, its own included) and a
point-to-point message. ``link_factor`` turns it into what crosses one rank's link; ``NodeDedup`` what a hybrid
DeepEP exchange sends across nodes. Which collectives a layout's code paths make: ``planner.comm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# the planner's group names -> the dimensions of the rank grid they span (``planner.grid.group_members``)
GROUP_DIMS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "tp_cp": ("tp", "cp"), "dp_cp": ("dp", "cp"), "tp_cp_dp": ("tp", "cp", "dp"),
    "pp": ("pp",), "ep": ("ep",), "etp": ("etp",), "etp_ep": ("etp", "ep"), "edp": ("edp",),
}
FP32, INT32, INT64 = 4, 4, 8


@dataclass(frozen=True)
class Collective:
    """One collective call of one rank. ``bytes``: the whole buffer (module docstring)."""

    group: str
    op: str
    bytes: int
    phase: str      # "forward" | "backward" (per micro-batch) | "step"
    region: str     # attention, core_attn, mla_up_proj, mlp, moe, dispatch, shared_experts, router, embedding,
    #                 head, pipeline, grad_sync, param_sync
    what: str = ""
    # checkpoints (block, mlp, moe, shared_experts) whose recompute stops before this forward collective: it
    # comes after the last tensor the region saves, and non-reentrant checkpointing recomputes no further
    trails: tuple[str, ...] = ()
    # compute the code runs while this collective is in flight (the alltoall/flex dispatch's token exchange is
    # left in flight while the MoE layer computes its shared experts)
    overlaps: str = ""
    # DeepEP V2's hybrid mode (``NodeDedup``): across nodes a token crosses the network once per destination node
    # and is forwarded over NVLink there (``bytes`` is still what the destination ranks receive)
    hybrid: NodeDedup | None = None


@dataclass(frozen=True)
class NodeDedup:
    """What decides a hybrid DeepEP exchange's network bytes once the ranks per node are known
    (``planner.step_time``): ``tokens`` sent, ``row_bytes`` each, their top-k of ``num_experts``."""

    tokens: int
    row_bytes: int
    num_experts: int
    topk: int

    def network_bytes(self, nodes: int) -> float:
        """Bytes one rank sends to other nodes: each token once per distinct remote node of its experts."""
        if nodes <= 1:
            return 0.0
        per_node = self.num_experts // nodes
        return self.tokens * distinct_ranks(self.num_experts, self.topk, per_node, nodes) * self.row_bytes \
            * (nodes - 1) / nodes


def link_factor(op: str, n: int) -> float:
    """Bytes over one rank's link per byte of ``Collective.bytes`` in a group of ``n`` (ring algorithms and a
    uniform all-to-all: each rank sends (n-1)/n of the buffer, twice for an all-reduce; a send once)."""
    if op == "send":
        return 1.0
    if n <= 1:
        return 0.0
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n


def distinct_ranks(E: int, K: int, e: int, ranks: int) -> float:
    """Expected number of ranks (of ``ranks``, ``e`` experts each) a token's K distinct uniform experts live on."""
    miss = math.comb(E - e, K) / math.comb(E, K) if E - e >= K else 0.0
    return ranks * (1.0 - miss)
