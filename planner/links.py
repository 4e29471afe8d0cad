"""The links a collective runs over, and its seconds there (the step-time model's communication: ``planner.step_time``).

``Links(sizes, cluster, gpus_per_node).seconds(c)``: one collective ``c`` over its group's link, NVLink when the
group's ranks share a node, else the network (an all-to-all spanning nodes: its intra-node share over NVLink and
the rest over the network at the same time; DeepEP V2's hybrid mode once per node, then NVLink).
``by_term(links, collectives, phase)``: those seconds summed per step-time term (``tp``, ``cp``, ``ep``, ``pp``,
``dp``) for the collectives of one phase.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from moefold.parallel.dims import ParallelSizes
from moefold.planner.cluster import Cluster
from moefold.planner.collective import GROUP_DIMS, Collective, link_factor
from moefold.planner.grid import group_members, ranks_per_node, spans_nodes

TERM_OF_GROUP = {"tp": "tp", "tp_cp": "tp", "tp_cp_dp": "tp", "cp": "cp", "ep": "ep", "etp": "ep", "etp_ep": "ep",
                  "pp": "pp", "dp_cp": "dp", "edp": "dp"}


@dataclass(frozen=True)
class Links:
    """The rank grid, the cluster's links and the node size that time a collective."""

    sizes: ParallelSizes
    cluster: Cluster
    gpus_per_node: int

    def seconds(self, c: Collective) -> float:
        """Time of one collective over its group's link (module docstring)."""
        members = group_ranks(self.sizes, c.group)
        n = len(members)
        nvlink, network = self.cluster.nvlink_gbps * 1e9, self.cluster.internode_gbps * 1e9
        if not spans_nodes(members, self.gpus_per_node):
            return c.bytes * link_factor(c.op, n) / nvlink
        if c.op == "all_to_all" and c.hybrid is not None:   # DeepEP V2 hybrid: once per node, then NVLink
            k = ranks_per_node(members, self.gpus_per_node)
            return max(c.bytes * (k - 1) / k / nvlink, c.hybrid.network_bytes(n // k) / network)
        if c.op == "all_to_all":
            k = ranks_per_node(members, self.gpus_per_node)
            return max(c.bytes * (k - 1) / n / nvlink, c.bytes * (n - k) / n / network)
        return c.bytes * link_factor(c.op, n) / network


@lru_cache(maxsize=4096)
def group_ranks(sizes: ParallelSizes, group: str) -> list[int]:
    """Rank 0's group ``group``: every group of a kind has the same shape in the rank grid."""
    return group_members(sizes, 0, GROUP_DIMS[group])


def by_term(links: Links, collectives: list[Collective], phase: str) -> dict[str, float]:
    """Seconds of the ``phase`` collectives among ``collectives``, per step-time term."""
    out: dict[str, float] = defaultdict(float)
    for c in collectives:
        if c.phase == phase:
            out[TERM_OF_GROUP[c.group]] += links.seconds(c)
    return out


__all__ = ["TERM_OF_GROUP", "Links", "by_term", "group_ranks"]
