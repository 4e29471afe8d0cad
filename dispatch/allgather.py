"""All-gather dispatcher: every rank of the etp x ep group sees every token, keeps its local experts' copies.

Dispatch: all-gather (over ``etp_ep_group``, W = etp * ep ranks) the tokens, padded to the largest
T in the group, together with their expert ids and probs, all in ONE all-gather (packed as bytes);
permute the copies whose expert is local. Combine: unpermute into [W * T_max, H] partial outputs
(only local experts' copies, each weighted by its prob, partial FFN sums under etp) and
reduce-scatter them back, which adds up every expert's and every etp shard's part.

Why the probs travel here (unlike alltoall): the reduce-scatter adds up each token's copies on
the expert side, so the per-copy weights must be applied before it; weighting on the home rank
would need every copy sent back separately (k times the combine's bytes). They ride the
all-gather that the routing needs anyway (4 bytes per copy next to the token's H * element
size), and their gradient the token gradient's reduce-scatter (one collective when both are fp32).
The collectives per layer are then those of the raw pattern (an all-gather of the tokens and a
reduce-scatter of the outputs, forward; the reverse in backward) plus the tiny count header.

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
import torch.distributed as dist
from torch import Tensor

from moefold.dispatch.alltoall import gather_counts
from moefold.dispatch.base import Dispatched, DispatchHandle, PendingDispatch, PhaseTimer, TokenDispatcher
from moefold.dispatch.fp8_exchange import dequantize_rows, fp8_round_trip, pack, quantize_rows, unpack
from moefold.dispatch.permutation import RowMap, build_row_map, group_counts, mask_groups, permute, unpermute
from moefold.dispatch.routing import Routing
from moefold.parallel.comm import reduce_scatter_sequence
from moefold.parallel.groups import Group, group_size


def _pad_rows(x: Tensor, rows: int, value: float = 0) -> Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), value)])


def _as_bytes(t: Tensor) -> Tensor:
    """[T, ...] -> [T, bytes per row] uint8 view (a copy only if ``t`` is not contiguous)."""
    return t.contiguous().reshape(t.shape[0], -1).view(torch.uint8)


class _GatherTokensAndRouting(torch.autograd.Function):
    """Forward: ONE all-gather of every rank's [tokens | expert ids | probs] rows, packed as bytes
    (exact for every dtype), unpacked into x_g [W*T, H], ids_g [W*T, K] int32, probs_g [W*T, K] fp32.

    Backward: reduce-scatter (sum) of the gradients of x_g and probs_g: one collective when both
    are fp32 (concatenated), else one each (the probs' gradient stays fp32).
    """

    @staticmethod
    def forward(ctx, x: Tensor, probs: Tensor | None, ids: Tensor, group: Group, fp8: bool):
        with torch.no_grad():   # fp8: the tokens travel as e4m3 rows with their scales (dispatch.fp8_exchange)
            x_bytes = pack(*quantize_rows(x)) if fp8 else _as_bytes(x)
        parts = [x_bytes, _as_bytes(ids)] + ([] if probs is None else [_as_bytes(probs)])
        widths = [p.shape[1] for p in parts]
        packed = torch.cat(parts, dim=1)
        n = group_size(group)
        out = packed.new_empty((n * packed.shape[0], packed.shape[1]))
        dist.all_gather_into_tensor(out, packed, group=group)
        ctx.group, ctx.x_dtype, ctx.has_probs, ctx.device = group, x.dtype, probs is not None, x.device
        cols = torch.split(out, widths, dim=1)
        # x_g stays a row-strided view of the received bytes (its row stride is a multiple of its
        # element size); the small ids / probs columns are copied to contiguous tensors
        if fp8:   # dequantised on arrival; the gradient returns in x's dtype (the cast is straight-through)
            x_g = dequantize_rows(*unpack(cols[0], x.shape[1]), x.dtype)
        else:
            x_g = cols[0].view(x.dtype).view(out.shape[0], *x.shape[1:])
        ids_g = cols[1].contiguous().view(ids.dtype)
        probs_g = cols[2].contiguous().view(probs.dtype) if probs is not None else None
        ctx.mark_non_differentiable(ids_g)
        ctx.x_g_shape = tuple(x_g.shape)
        ctx.probs_g_shape = None if probs_g is None else tuple(probs_g.shape)
        return x_g, ids_g, probs_g

    @staticmethod
    def backward(ctx, grad_x: Tensor | None, _grad_ids: Tensor | None, grad_probs: Tensor | None):
        group = ctx.group
        need_x, need_p = ctx.needs_input_grad[0], ctx.has_probs and ctx.needs_input_grad[1]
        if need_x and grad_x is None:
            grad_x = torch.zeros(ctx.x_g_shape, dtype=ctx.x_dtype, device=ctx.device)
        if need_p and grad_probs is None:
            grad_probs = torch.zeros(ctx.probs_g_shape, dtype=torch.float32, device=ctx.device)
        if need_x and need_p and grad_x.dtype == grad_probs.dtype:  # one reduce-scatter for both
            H = grad_x[0].numel()
            both = _reduce_scatter(torch.cat([grad_x.reshape(grad_x.shape[0], -1), grad_probs], dim=1), group)
            return both[:, :H].reshape(-1, *grad_x.shape[1:]), both[:, H:], None, None, None
        return (_reduce_scatter(grad_x, group) if need_x else None,
                _reduce_scatter(grad_probs, group) if need_p else None, None, None, None)


def _reduce_scatter(x: Tensor, group: Group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


@dataclass(frozen=True)
class AllGatherHandle(DispatchHandle):
    """row_map over the gathered [W * max_tokens] tokens; probs_g: their gathered probs [W * max_tokens, K]
    (None: unweighted combine); max_tokens: the per-rank padding length."""

    row_map: RowMap
    probs_g: Tensor | None
    max_tokens: int


class AllGatherDispatcher(TokenDispatcher):
    """All-gather over ``etp_ep_group`` (the etp x ep ranks), keep the experts of this ep rank.

    ``ep_group`` places the experts (ep rank r holds experts r*e .. r*e+e-1); ``etp_ep_group`` must
    contain exactly the ranks of this rank's ep and etp groups (``ParallelDims.etp_ep_group``).
    When ep or etp is 1 it may be None and is taken to be the other group.
    ``fp8``: the tokens are gathered as e4m3 with their scales (``dispatch.fp8_exchange``).
    """

    name = "allgather"
    staged = False   # the tokens and routing travel in one all-gather inside dispatch_start

    def __init__(self, num_experts: int, ep_group: Group = None, etp_group: Group = None,
                 etp_ep_group: Group = None, timer: PhaseTimer | None = None, fp8: bool = False):
        super().__init__(num_experts, ep_group, etp_group, timer)
        self.group = self._etp_ep_group(etp_ep_group)
        self.fp8 = fp8

    def dispatch_start(self, x_TH: Tensor, routing: Routing, *, weighted_combine: bool = True) -> PendingDispatch:
        self._check(x_TH, routing)
        T, K = routing.probs_TK.shape
        E, e, W = self.num_experts, self.num_local_experts, self.ep * self.etp
        local = slice(self.local_expert_offset, self.local_expert_offset + e)
        with self._phase("permute"):
            # Copies dropped at the source travel as expert id -1, so keep needs no separate gather.
            ids = routing.expert_ids_TK
            if routing.keep_TK is not None:
                ids = ids.masked_fill(~routing.keep_TK.bool(), -1)
            counts_E = group_counts(mask_groups(ids, E), E)
            # T and the capacity ride along: capacity is per rank (it grows with T), and in padded
            # mode every rank must pad every source's chunks to the same size
            cap = int(routing.capacity) if routing.pad_to_capacity else 0
            # filled on the device: new_tensor([T, cap]) would be a blocking host->device copy
            header = torch.cat([counts_E, counts_E.new_full((1,), T), counts_E.new_full((1,), cap)])
        with self._phase("communicate"):
            all_header = gather_counts(header, self.group)  # [W, E + 2]: the layer's one exchange of counts
            host = all_header.tolist()  # the dispatch's one host synchronisation
            max_tokens = max(h[E] for h in host)
            probs = _pad_rows(routing.probs_TK.float(), max_tokens) if weighted_combine else None
            ids_pad = _pad_rows(ids.to(torch.int32), max_tokens, -1)
            if W == 1:
                xg, ids_g, probs_g = (fp8_round_trip(x_TH) if self.fp8 else x_TH), ids_pad, probs
            else:  # tokens, expert ids and probs in one all-gather
                xg, ids_g, probs_g = _GatherTokensAndRouting.apply(_pad_rows(x_TH, max_tokens), probs, ids_pad,
                                                                   self.group, self.fp8)
        with self._phase("permute"):
            local_ids = ids_g.long() - self.local_expert_offset
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
        handle = AllGatherHandle(num_tokens=T, num_rows=tokens.shape[0], row_map=row_map, probs_g=probs_g,
                                 max_tokens=max_tokens)
        result = Dispatched(tokens, per_expert, handle, per_expert_host)
        return PendingDispatch(lambda: result)

    def combine(self, expert_out_NH: Tensor, handle: DispatchHandle) -> Tensor:
        self._check_combine(expert_out_NH, handle, AllGatherHandle)
        assert isinstance(handle, AllGatherHandle)
        with self._phase("unpermute"):
            # each rank weights and sums the copies of its experts: [W * max_tokens, H] partial outputs, fp32 for
            # bf16 rows (combine_dtype), so the reduce-scatter adds them up in fp32 as Megatron-Core's does
            partial = unpermute(expert_out_NH, handle.row_map, handle.probs_g)
        with self._phase("communicate"):
            y = reduce_scatter_sequence(partial, self.group, 0)
        return y[:handle.num_tokens]
