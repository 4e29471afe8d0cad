"""All-gather dispatcher: every rank of the etp x ep group sees every token, keeps its local experts' copies.

Dispatch: all-gather (over ``etp_ep_group``, W = etp * ep ranks) the tokens, padded to the largest
T in the group, together with their expert ids and probs, all in ONE all-gather (packed as bytes);
permute the copies whose expert is local, and their probs (``Dispatched.probs_N``: the experts weight each
row by it inside their activation, as Megatron-Core's allgather dispatcher hands its ``local_probs`` to the
experts). Combine: unpermute into [W * T_max, H] partial outputs (only local experts' copies, already
weighted, partial FFN sums under etp) and reduce-scatter them back, which adds up every expert's and every
etp shard's part.

The probs ride the all-gather that the routing needs anyway (4 bytes per copy next to the token's
H * element size), and their gradient the token gradient's reduce-scatter (one collective when both are
fp32). The collectives per layer are then those of the raw pattern (an all-gather of the tokens and a
reduce-scatter of the outputs, forward; the reverse in backward) plus the tiny count header.

With ``pad_to_capacity`` every (local expert, source rank) chunk is padded to the largest capacity
in the group (capacity is per rank and grows with its T; it travels with the token counts, so
uneven T, even T = 0, costs nothing extra).

Stages (``dispatch.base.Dispatcher``): ``prepare_dispatch`` gathers the header (counts, T and capacity of every
rank: the one host synchronisation per MoE layer, in every mode) and pads to T_max; the dispatch exchange is the
one gather of tokens, ids and probs (``AllGatherExchange``: the ids arrive as its ``meta``); ``finish_dispatch``
permutes the local experts' copies and their probs. ``prepare_combine`` sums them into the partial outputs, the
combine exchange reduce-scatters them (``ReduceScatterExchange``), ``finish_combine`` keeps this rank's T rows.
The gather runs when its exchange starts, so nothing overlaps it.

Simple and static-shaped (good for small ep or when most tokens are wanted by every rank);
it moves W times the tokens, so large ep wants the all-to-all dispatcher instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moefold.dispatch.alltoall import gather_counts
from moefold.dispatch.base import Dispatched, DispatchHandle, DispatchPrep, PhaseTimer, TokenDispatcher
from moefold.dispatch.config import DispatcherKind
from moefold.dispatch.fp8_exchange import dequantize_rows, pack, quantize_rows, unpack
from moefold.dispatch.permutation import (
    RowMap,
    build_padded_row_map,
    build_row_map,
    group_counts,
    mask_groups,
    pad_counts,
    permute,
    permute_probs,
    unpermute,
)
from moefold.dispatch.routing import Routing
from moefold.dispatch.token_exchange import Arrival, InFlight, TokenExchange
from moefold.parallel.comm import all_gather_single, reduce_scatter_single
from moefold.parallel.groups import Group, group_size


def _pad_rows(x: Tensor, rows: int, value: float = 0) -> Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), value)])


def _as_bytes(t: Tensor) -> Tensor:
    """[T, ...] -> [T, bytes per row] uint8 view (a copy only if ``t`` is not contiguous)."""
    return t.contiguous().reshape(t.shape[0], -1).view(torch.uint8)


def _reduce_scatter(x: Tensor, group: Group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size(group), *x.shape[1:]))
    reduce_scatter_single(out, x, group)
    return out


def _all_gather(x: Tensor, group: Group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x, group)
    return out


@dataclass(frozen=True)
class GatheredIds:
    """What the dispatch exchange delivers besides the rows: every rank's [T_max, K] int32 expert ids, stacked
    ([W * T_max, K]; -1 for dropped copies and padding tokens)."""

    ids_g: Tensor


@dataclass(frozen=True)
class AllGatherExchange(TokenExchange[GatheredIds]):
    """Forward: ONE all-gather over ``group`` (W ranks) of every rank's [tokens | expert ids | probs] rows, packed
    as bytes (exact for every dtype; with ``fp8`` the tokens as e4m3 rows with their scales,
    ``dispatch.fp8_exchange``), unpacked into x_g [W*T, H] (dequantised to the tokens' dtype), probs_g [W*T, K] fp32
    and the ids (``GatheredIds``). One rank: nothing moves (FP8 rows are still cast, as a larger group's are).

    Backward: reduce-scatter (sum) of the gradients of x_g and probs_g: one collective when both are fp32
    (concatenated), else one each (the probs' gradient stays fp32); the FP8 cast counts as the identity."""

    ids_TK: Tensor
    group: Group
    fp8: bool = False

    def start(self, *tensors: Tensor) -> InFlight[Arrival[GatheredIds]]:
        """``(x [T, H], probs [T, K] fp32)`` or ``(x,)`` (no probs: the experts run unweighted) -> (x_g[, probs_g]),
        GatheredIds."""
        x, *probs = tensors
        if group_size(self.group) == 1:
            x_g = x
            if self.fp8:
                x_g = dequantize_rows(*unpack(pack(*quantize_rows(x)), x.shape[1]), x.dtype)
            arrival = Arrival((x_g, *probs), GatheredIds(self.ids_TK))
            return InFlight(lambda: arrival)
        x_bytes = pack(*quantize_rows(x)) if self.fp8 else _as_bytes(x)
        parts = [x_bytes, _as_bytes(self.ids_TK)] + [_as_bytes(p) for p in probs]
        widths = [p.shape[1] for p in parts]
        packed = torch.cat(parts, dim=1)
        out = packed.new_empty((group_size(self.group) * packed.shape[0], packed.shape[1]))
        all_gather_single(out, packed, self.group)
        cols = torch.split(out, widths, dim=1)
        # x_g stays a row-strided view of the received bytes (its row stride is a multiple of its element size);
        # the small ids / probs columns are copied to contiguous tensors
        if self.fp8:
            x_g = dequantize_rows(*unpack(cols[0], x.shape[1]), x.dtype)
        else:
            x_g = cols[0].view(x.dtype).view(out.shape[0], *x.shape[1:])
        ids_g = cols[1].contiguous().view(self.ids_TK.dtype)
        received = (x_g, *(cols[2].contiguous().view(p.dtype) for p in probs))
        arrival = Arrival(received, GatheredIds(ids_g))
        return InFlight(lambda: arrival)

    def start_backward(self, grads: Sequence[Tensor], meta: GatheredIds) -> InFlight[tuple[Tensor, ...]]:
        if group_size(self.group) == 1:
            result = tuple(grads)
            return InFlight(lambda: result)
        if len(grads) == 2 and grads[0].dtype == grads[1].dtype:   # one reduce-scatter for both
            grad_x, grad_p = grads
            H = grad_x[0].numel()
            both = _reduce_scatter(torch.cat([grad_x.reshape(grad_x.shape[0], -1), grad_p], dim=1), self.group)
            result = (both[:, :H].reshape(-1, *grad_x.shape[1:]), both[:, H:])
        else:
            result = tuple(_reduce_scatter(g, self.group) for g in grads)
        return InFlight(lambda: result)


@dataclass(frozen=True)
class ReduceScatterExchange(TokenExchange[None]):
    """The allgather combine's exchange: forward a reduce-scatter (sum) of [W * T_max, H] partial outputs over
    ``group``, each rank keeping its [T_max, H]; backward the all-gather of the gradient. One rank: nothing moves."""

    group: Group

    def start(self, *tensors: Tensor) -> InFlight[Arrival[None]]:
        (partial,) = tensors
        y = partial if group_size(self.group) == 1 else _reduce_scatter(partial, self.group)
        arrival = Arrival((y,), None)
        return InFlight(lambda: arrival)

    def start_backward(self, grads: Sequence[Tensor], meta: None) -> InFlight[tuple[Tensor, ...]]:
        (grad,) = grads
        result = (grad if group_size(self.group) == 1 else _all_gather(grad, self.group),)
        return InFlight(lambda: result)


@dataclass(frozen=True)
class AllGatherPrep(DispatchPrep):
    """``prepare_dispatch``'s findings: the exchange (it holds the padded ids), the gathered header as host ints
    (``host[w]``: rank w's [E] counts, T and capacity) and on the device, the padding length, the routing's modes."""

    exchange: AllGatherExchange
    host: list[list[int]]
    header_WE: Tensor
    max_tokens: int
    pad_to_capacity: bool
    pad_multiple: int | None


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

    kind = DispatcherKind.ALLGATHER
    name = "allgather"

    def __init__(self, num_experts: int, ep_group: Group = None, etp_group: Group = None,
                 etp_ep_group: Group = None, timer: PhaseTimer | None = None, fp8: bool = False):
        super().__init__(num_experts, ep_group, etp_group, timer)
        self.group = self._etp_ep_group(etp_ep_group)
        self.fp8 = fp8

    # -- dispatch: prepare (the header's gather: the one host sync; padding) -> exchange (the one gather) -> finish
    def prepare_dispatch(self, x_TH: Tensor, routing: Routing, *, with_probs: bool = True,
                         ) -> tuple[tuple[Tensor, ...], AllGatherPrep]:
        self._check(x_TH, routing)
        T = routing.num_tokens
        E = self.num_experts
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
            sent = (_pad_rows(x_TH, max_tokens),)
            if with_probs:
                sent += (_pad_rows(routing.probs_TK.float(), max_tokens),)
            exchange = AllGatherExchange(_pad_rows(ids.to(torch.int32), max_tokens, -1), self.group, self.fp8)
        prep = AllGatherPrep(num_tokens=T, exchange=exchange, host=host, header_WE=all_header, max_tokens=max_tokens,
                             pad_to_capacity=routing.pad_to_capacity, pad_multiple=routing.pad_multiple)
        return sent, prep

    def dispatch_exchange(self, prep: AllGatherPrep) -> AllGatherExchange:
        return prep.exchange

    def finish_dispatch(self, received: tuple[Tensor, ...], meta: GatheredIds, prep: AllGatherPrep,
                        ) -> Dispatched[AllGatherHandle]:
        xg, *probs = received
        ids_g, host, max_tokens = meta.ids_g, prep.host, prep.max_tokens
        K = ids_g.shape[1]
        E, e, W = self.num_experts, self.num_local_experts, self.ep * self.etp
        local = slice(self.local_expert_offset, self.local_expert_offset + e)
        with self._phase("permute"):
            local_ids = ids_g.long() - self.local_expert_offset
            if prep.pad_to_capacity:
                # Ranks with fewer tokens have a smaller capacity (a rank with none has 0): pad every
                # (expert, source) chunk to the group's largest, which all ranks agree on. Each source
                # kept at most its own capacity per expert, so nothing more is dropped here.
                cap = max(h[E + 1] for h in host)
                # group = (local expert, source rank): each source's chunk is padded separately
                src = torch.arange(W * max_tokens, device=ids_g.device).div(max_tokens, rounding_mode="floor")
                in_range = (local_ids >= 0) & (local_ids < e)
                key_TK = torch.where(in_range, local_ids * W + src.unsqueeze(1), -1)
                row_map = build_row_map(mask_groups(key_TK, e * W), W * max_tokens, K, e * W, capacity=cap)
                per_expert = torch.full((e,), W * cap, dtype=torch.long, device=xg.device)
                per_expert_host = (W * cap,) * e
            elif prep.pad_multiple is not None:
                # every (local expert, source rank) chunk padded to the multiple with zero rows, in the row map
                src = torch.arange(W * max_tokens, device=ids_g.device).div(max_tokens, rounding_mode="floor")
                in_range = (local_ids >= 0) & (local_ids < e)
                key_TK = torch.where(in_range, local_ids * W + src.unsqueeze(1), -1)
                chunks = [host[w][local.start + j] for j in range(e) for w in range(W)]
                row_map = build_padded_row_map(mask_groups(key_TK, e * W), W * max_tokens, K, e * W, chunks,
                                               prep.pad_multiple)
                per_expert = row_map.counts_G.view(e, W).sum(1)
                padded = pad_counts(chunks, prep.pad_multiple)
                per_expert_host = tuple(sum(padded[j * W:(j + 1) * W]) for j in range(e))
            else:
                num_rows = sum(sum(h[local]) for h in host)
                row_map = build_row_map(mask_groups(local_ids, e), W * max_tokens, K, e, num_rows=num_rows)
                per_expert = prep.header_WE[:, local].sum(0)
                per_expert_host = tuple(sum(h[g] for h in host) for g in range(local.start, local.stop))
            tokens = permute(xg, row_map)
            probs_N = permute_probs(probs[0], row_map) if probs else None
        handle = AllGatherHandle(num_tokens=prep.num_tokens, num_rows=tokens.shape[0], row_map=row_map,
                                 max_tokens=max_tokens)
        return Dispatched(tokens, per_expert, handle, per_expert_host, probs_N=probs_N)

    # -- combine: prepare (sum the local copies) -> exchange (the reduce-scatter) -> finish (T rows) ------------
    def prepare_combine(self, expert_out_NH: Tensor, handle: AllGatherHandle) -> tuple[Tensor, ...]:
        self._check_combine(expert_out_NH, handle, AllGatherHandle)
        with self._phase("unpermute"):
            # each rank sums the (weighted) copies of its experts: [W * max_tokens, H] partial outputs, fp32 for
            # bf16 rows (combine_dtype), so the reduce-scatter adds them up in fp32 as Megatron-Core's does
            return (unpermute(expert_out_NH, handle.row_map),)

    def combine_exchange(self, handle: AllGatherHandle) -> ReduceScatterExchange:
        return ReduceScatterExchange(self.group)

    def finish_combine(self, received: tuple[Tensor, ...], handle: AllGatherHandle) -> Tensor:
        return received[0][:handle.num_tokens]
