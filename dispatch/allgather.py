"""All-gather dispatcher: every rank of the etp x ep group sees every token, keeps its local experts' copies.

Dispatch: all-gather (over ``etp_ep_group``, W = etp * ep ranks) the tokens, padded to the largest
T in the group, together with their routing; permute the copies whose expert is local. Combine:
unpermute into [W * T_max, H] partial outputs (only local experts' copies, partial FFN sums under
etp) and reduce-scatter them back, which adds up every expert's and every etp shard's part.

With ``pad_to_capacity`` every (local expert, source rank) chunk is padded to the largest capacity
in the group (capacity is per rank and grows with its T; it travels with the token counts, so
uneven T, even T = 0, costs nothing extra).

Simple and static-shaped (good for small ep or when most tokens are wanted by every rank);
it moves W times the tokens, so large ep wants the all-to-all dispatcher instead. One host
synchronisation per MoE layer (the gathered header: counts, T and capacity of every rank), in
every mode; the gathers finish inside ``dispatch_start``, so nothing overlaps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moefold.dispatch.alltoall import gather_counts
from moefold.dispatch.base import Dispatched, DispatchHandle, PendingDispatch, PhaseTimer, TokenDispatcher
from moefold.dispatch.fp8_exchange import fp8_all_gather
from moefold.dispatch.permutation import (
    RowMap,
    build_row_map,
    group_counts,
    mask_groups,
    permute,
    permute_probs,
    unpermute,
)
from moefold.moe.routing import Routing
from moefold.parallel.comm import all_gather_sequence, reduce_scatter_sequence
from moefold.parallel.groups import Group, group_size


def _pad_rows(x: Tensor, rows: int, value: float = 0) -> Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), value)])


@dataclass(frozen=True)
class AllGatherHandle(DispatchHandle):
    """row_map over the gathered [W * max_tokens] tokens; max_tokens: the per-rank padding length."""

    row_map: RowMap
    max_tokens: int


class AllGatherDispatcher(TokenDispatcher):
    """All-gather over ``etp_ep_group`` (the etp x ep ranks), keep the experts of this ep rank.

    ``ep_group`` places the experts (ep rank r holds experts r*e .. r*e+e-1); ``etp_ep_group`` must
    contain exactly the ranks of this rank's ep and etp groups (``ParallelDims.etp_ep_group``).
    When ep or etp is 1 it may be None and is taken to be the other group.
    ``fp8``: the tokens are gathered as e4m3 with their scales (``dispatch.fp8_exchange``).
    """

    name = "allgather"

    def __init__(self, num_experts: int, ep_group: Group = None, etp_group: Group = None,
                 etp_ep_group: Group = None, timer: PhaseTimer | None = None, fp8: bool = False):
        super().__init__(num_experts, ep_group, etp_group, timer)
        self._gather_rows = fp8_all_gather if fp8 else all_gather_sequence
        if etp_ep_group is None:
            if self.ep > 1 and self.etp > 1:
                raise ValueError(f"allgather dispatcher with ep={self.ep} and etp={self.etp} needs the etp_ep_group")
            etp_ep_group = ep_group if self.ep > 1 else etp_group
        if group_size(etp_ep_group) != self.ep * self.etp:
            raise ValueError(f"etp_ep_group has {group_size(etp_ep_group)} ranks, expected ep*etp="
                             f"{self.ep}*{self.etp}={self.ep * self.etp}")
        self.group = etp_ep_group

    def dispatch_start(self, x_TH: Tensor, routing: Routing) -> PendingDispatch:
        self._check(x_TH, routing)
        T, K = routing.probs_TK.shape
        E, e, W = self.num_experts, self.num_local_experts, self.ep * self.etp
        local = slice(self.local_expert_offset, self.local_expert_offset + e)
        with self._phase("permute"):
            # Copies dropped at the source travel as expert id -1, so keep needs no separate gather.
            ids = routing.expert_ids_TK.long()
            if routing.keep_TK is not None:
                ids = ids.masked_fill(~routing.keep_TK.bool(), -1)
            counts_E = group_counts(mask_groups(ids, E), E)
            # T and the capacity ride along: capacity is per rank (it grows with T), and in padded
            # mode every rank must pad every source's chunks to the same size
            cap = int(routing.capacity) if routing.pad_to_capacity else 0
            # filled on the device: new_tensor([T, cap]) would be a blocking host->device copy
            header = torch.cat([counts_E, counts_E.new_full((1,), T), counts_E.new_full((1,), cap)])
        with self._phase("communicate"):
            all_header = gather_counts(header, self.group)  # [W, E + 2]
            host = all_header.tolist()  # the dispatch's one host synchronisation
            max_tokens = max(h[E] for h in host)
            xg = self._gather_rows(_pad_rows(x_TH, max_tokens), self.group, 0)
            probs_g = all_gather_sequence(_pad_rows(routing.probs_TK.float(), max_tokens), self.group, 0)
            ids_g = gather_counts(_pad_rows(ids, max_tokens, -1), self.group).view(W * max_tokens, K)
        with self._phase("permute"):
            local_ids = ids_g - self.local_expert_offset
            if routing.pad_to_capacity:
                # Ranks with fewer tokens have a smaller capacity (a rank with none has 0): pad every
                # (expert, source) chunk to the group's largest, which all ranks agree on. Each source
                # kept at most its own capacity per expert, so nothing more is dropped here.
                cap = max(h[E + 1] for h in host)
                # group = (local expert, source rank): each source's chunk is padded separately
                src = torch.arange(W * max_tokens, device=ids_g.device).div(max_tokens, rounding_mode="floor")
                in_range = (local_ids >= 0) & (local_ids < e)
                key_TK = torch.where(in_range, local_ids * W + src.unsqueeze(1), -1)
                row_map = build_row_map(mask_groups(key_TK, e * W), W * max_tokens, K, e * W, capacity=cap)
                per_expert = torch.full((e,), W * cap, dtype=torch.long, device=x_TH.device)
                per_expert_host = (W * cap,) * e
            else:
                num_rows = sum(sum(h[local]) for h in host)
                row_map = build_row_map(mask_groups(local_ids, e), W * max_tokens, K, e, num_rows=num_rows)
                per_expert = all_header[:, local].sum(0)
                per_expert_host = tuple(sum(h[g] for h in host) for g in range(local.start, local.stop))
            tokens = permute(xg, row_map)
            probs_N = permute_probs(probs_g, row_map)
        handle = AllGatherHandle(num_tokens=T, num_rows=tokens.shape[0], row_map=row_map, max_tokens=max_tokens)
        result = Dispatched(tokens, probs_N, per_expert, handle, per_expert_host)
        return PendingDispatch(lambda: result)

    def combine(self, expert_out_NH: Tensor, handle: DispatchHandle) -> Tensor:
        self._check_combine(expert_out_NH, handle, AllGatherHandle)
        assert isinstance(handle, AllGatherHandle)
        with self._phase("unpermute"):
            partial = unpermute(expert_out_NH, handle.row_map)  # [W * max_tokens, H]
        with self._phase("communicate"):
            y = reduce_scatter_sequence(partial, self.group, 0)
        return y[:handle.num_tokens]
