"""All-to-all dispatcher over ep, with an all-gather / reduce-scatter inside etp.

Dispatch on rank (etp t, ep r):

1. counts:      all-gather the [E] per-expert counts over the etp x ep group -> [etp, ep, E]: the
                layer's one exchange of split sizes (launched first, so the argsort and permute
                overlap it), then the dispatch's one host synchronisation (``.tolist()``: the
                exchange needs its split sizes on the host)
2. permute:     this rank's kept copies -> rows sorted by global expert (hence by destination ep rank)
3. all-to-all:  uneven, over ep (the dispatch exchange, asynchronous: in flight from its ``start`` to its
                ``wait``)
4. etp gather:  every etp rank receives every other's rows -> [etp src, ep src, e_local] chunks
5. sort:        regroup chunks to [e_local, etp src, ep src] (expert-major)

The routing probs travel with the rows (as in Megatron-Core's alltoall dispatcher): permuted with them
(``permute_probs``), exchanged by a second all-to-all of [N] fp32 with the same splits, gathered over etp
and sorted like them: ``Dispatched.probs_N``, which the experts apply inside their activation; the probs'
gradient returns the same way in backward. Combine runs the mirror image: unsort, reduce-scatter over etp
(sums the experts' partial FFN outputs; in fp32 for bf16 rows), reverse all-to-all (``return_tokens``),
then unpermute: each token's k returned (already weighted) copies summed in fp32
(``dispatch.permutation.combine_dtype``) on the home rank. For bf16 tokens ``combine`` returns that fp32
sum (the MoE layer rounds it once).

Host synchronisations per MoE layer (forward and backward together, proved by
tests/dispatch/test_host_sync.py): dropless or unpadded capacity mode exactly one (the split
sizes; the backward reuses them from the handle); padded mode none. (ep = etp = 1: ``dispatch.local``.)

With ``pad_to_capacity`` every expert's chunk from every rank is exactly ``capacity`` rows, so
all sizes are static and nothing is exchanged or synchronised besides the tokens. That needs the
same capacity on every rank of the etp x ep group, i.e. (capacity being per rank,
ceil(T*K/E*factor)) the same token count T on each, as in Megatron. It is not checked: checking
would cost the very collective and host sync that padded mode exists to avoid, and a mismatch
breaks the exchange itself (gloo aborts the process on mismatched split sizes). With uneven token
counts (e.g. a rank with none) use the allgather dispatcher, which pads to the group's largest
capacity, or the unpadded capacity mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.dispatch.base import Dispatched, DispatchHandle, DispatchPrep, PhaseTimer, TokenDispatcher
from moefold.dispatch.config import DispatcherKind
from moefold.dispatch.permutation import (
    RowMap,
    build_padded_row_map,
    build_row_map,
    combine_dtype,
    group_counts,
    mask_groups,
    pad_counts,
    permute,
    permute_probs,
    sort_chunks,
    unpermute,
)
from moefold.dispatch.routing import Routing
from moefold.dispatch.token_exchange import AllToAllExchange, exchange_with_grad
from moefold.parallel.comm import all_gather_sequence, all_gather_single, all_to_all, reduce_scatter_sequence
from moefold.parallel.groups import Group, group_size


def gather_counts(counts: Tensor, group: Group, async_op: bool = False) -> Tensor | tuple[Tensor, dist.Work | None]:
    """All-gather (no autograd) a small tensor over ``group``: [...] -> [n, ...].

    With ``async_op`` returns (output, work); read the output only after ``work.wait()``.
    """
    n = group_size(group)
    if n == 1:
        return (counts.unsqueeze(0), None) if async_op else counts.unsqueeze(0)
    flat = counts.reshape(-1).contiguous()
    out = flat.new_empty(n * flat.shape[0])
    work = all_gather_single(out, flat, group, async_op=async_op)
    out = out.view(n, *counts.shape)
    return (out, work) if async_op else out


def all_gather_uneven(x: Tensor, sizes: list[int], group: Group) -> Tensor:
    """Concatenate every rank's rows (rank i has ``sizes[i]`` rows) on every rank, with autograd.

    Backward sums the gradient over the group (a reduce-scatter). Equal sizes use the plain
    all-gather; uneven ones an all-to-all that sends the whole buffer to every rank.
    """
    n = group_size(group)
    if n == 1:
        return x
    if len(set(sizes)) == 1:
        return all_gather_sequence(x, group, 0)
    return all_to_all(x.repeat(n, *([1] * (x.dim() - 1))), list(sizes), [x.shape[0]] * n, group)


def reduce_scatter_uneven(x: Tensor, sizes: list[int], group: Group, rank: int) -> Tensor:
    """Sum over the group of every rank's [sum(sizes), ...] and keep this rank's ``sizes[rank]`` rows.

    The adjoint of ``all_gather_uneven``.
    """
    n = group_size(group)
    if n == 1:
        return x
    if len(set(sizes)) == 1:
        return reduce_scatter_sequence(x, group, 0)
    mine = sizes[rank]
    received = all_to_all(x, [mine] * n, list(sizes), group)
    return received.view(n, mine, *x.shape[1:]).sum(0)


@dataclass(frozen=True)
class ExchangePlan:
    """Split sizes of the token all-to-all over ep, host ints (rows sent to / received from each ep
    rank). When the exchange is chunked per local expert j: ``chunk_send[j][d]`` rows of local
    expert j go to rank d, ``chunk_recv[j][s]`` come from rank s; else both are None."""

    send: tuple[int, ...]
    recv: tuple[int, ...]
    chunk_send: tuple[tuple[int, ...], ...] | None = None
    chunk_recv: tuple[tuple[int, ...], ...] | None = None



    def exchange(self, group: Group, fp8: bool = False) -> AllToAllExchange:
        """The dispatch direction of this plan over ``group`` (``reverse()`` is the combine's)."""
        if self.chunk_send is not None:
            return AllToAllExchange(self.chunk_send, self.chunk_recv, group, fp8)
        return AllToAllExchange((self.send,), (self.recv,), group, fp8)


def exchange_tokens(rows_NH: Tensor, plan: ExchangePlan, group: Group, fp8: bool = False) -> Tensor:
    """The dispatch's token all-to-all over ep, with autograd (backward: the reverse exchange of the
    gradients): rows in send order (grouped by destination rank, or [local expert x destination] when
    chunked) -> rows received from every ep rank (by source, or [local expert x source] when chunked).
    ``fp8``: the rows travel as e4m3 with their scales and arrive dequantised (``dispatch.fp8_exchange``)."""
    return exchange_with_grad(plan.exchange(group, fp8), rows_NH).wait()[1][0]


def return_tokens(rows_NH: Tensor, plan: ExchangePlan, group: Group) -> Tensor:
    """The combine's exchange: ``exchange_tokens`` in reverse (received order -> send order)."""
    return exchange_with_grad(plan.exchange(group).reverse(), rows_NH).wait()[1][0]


@dataclass(frozen=True)
class AllToAllHandle(DispatchHandle):
    """row_map: this rank's permutation; plan: the ep exchange's split sizes; etp_sizes: rows each etp
    rank contributed to the gather; chunk_counts: [etp*ep, e_local] chunk sizes (device)."""

    row_map: RowMap
    plan: ExchangePlan
    etp_sizes: tuple[int, ...]
    chunk_counts: Tensor


@dataclass(frozen=True)
class AllToAllPrep(DispatchPrep):
    """What ``prepare_dispatch`` found out for the other stages: the handle's fields and ``recv``, the host counts
    [etp][ep src][e_local] (None when nothing was exchanged)."""

    row_map: RowMap
    plan: ExchangePlan
    etp_sizes: tuple[int, ...]
    chunk_counts: Tensor
    recv: list[list[list[int]]] | None


class AllToAllDispatcher(TokenDispatcher):
    """Uneven all-to-all over ``ep_group``, all-gather / reduce-scatter over ``etp_group``.

    Groups are explicit; ``None`` (or size 1) means no communication along that dimension.
    ``etp_ep_group`` (the etp x ep ranks, ep-major: ``ParallelDims.etp_ep_group``) carries the one
    exchange of split sizes when ep and etp are both > 1; with either at 1 it is the other group.
    With etp = 1 and at most ``max_chunked_experts`` local experts, the exchange is one
    all-to-all per local expert landing rows directly in expert-major order (``AllToAllExchange``'s chunks),
    which saves the two sort copies; beyond that, one all-to-all plus ``sort_chunks``.
    ``fp8``: the token rows travel as e4m3 with their scales (``dispatch.fp8_exchange``).
    ``max_chunked_experts``: ``DispatchConfig.max_chunked_experts`` (checked there).
    """

    kind = DispatcherKind.ALLTOALL
    name = "alltoall"

    def __init__(self, num_experts: int, ep_group: Group = None, etp_group: Group = None,
                 etp_ep_group: Group = None, timer: PhaseTimer | None = None, max_chunked_experts: int = 8,
                 fp8: bool = False):
        super().__init__(num_experts, ep_group, etp_group, timer)
        self.fp8 = fp8
        e = self.num_local_experts
        self.chunked = self.etp == 1 and self.ep > 1 and 1 < e <= max_chunked_experts
        self.counts_group = self._etp_ep_group(etp_ep_group)

    def _send_key(self, key: Tensor) -> Tensor:
        """Chunked exchange: order the send rows [local expert index j x destination rank]."""
        E, e, ep = self.num_experts, self.num_local_experts, self.ep
        return torch.where(key < E, (key % e) * ep + key.div(e, rounding_mode="floor"), key)

    def _plan(self, mine: list[int], recv: list[list[list[int]]]) -> tuple[ExchangePlan, tuple[int, ...]]:
        """(plan, etp_sizes) from this rank's per-expert counts ``mine`` [E] and ``recv`` [etp][ep][e]."""
        e, ep, etp = self.num_local_experts, self.ep, self.etp
        send = tuple(sum(mine[d * e:(d + 1) * e]) for d in range(ep))
        recv_splits = tuple(sum(recv[self.etp_rank][s]) for s in range(ep))
        etp_sizes = tuple(sum(sum(c) for c in recv[t]) for t in range(etp))
        if not self.chunked:
            return ExchangePlan(send, recv_splits), etp_sizes
        chunk_send = tuple(tuple(mine[d * e + j] for d in range(ep)) for j in range(e))
        chunk_recv = tuple(tuple(recv[0][s][j] for s in range(ep)) for j in range(e))
        return ExchangePlan(send, recv_splits, chunk_send, chunk_recv), etp_sizes

    # -- dispatch: prepare (counts, permute) -> exchange (all-to-all over ep) -> finish (etp gather, sort) ------
    def prepare_dispatch(self, x_TH: Tensor, routing: Routing, *, with_probs: bool = True,
                         ) -> tuple[tuple[Tensor, ...], AllToAllPrep]:
        self._check(x_TH, routing)
        T, K = routing.probs_TK.shape
        E, e, ep, etp = self.num_experts, self.num_local_experts, self.ep, self.etp
        local = slice(self.local_expert_offset, self.local_expert_offset + e)
        with self._phase("permute"):
            key = mask_groups(routing.expert_ids_TK, E, routing.keep_TK)
            send_key = self._send_key(key) if self.chunked else key
            if routing.pad_to_capacity:
                # every (rank, expert) chunk is `capacity` rows: all sizes static, nothing exchanged but tokens
                cap = int(routing.capacity)
                mine, recv = [cap] * E, [[[cap] * e for _ in range(ep)] for _ in range(etp)]
                chunk_counts = torch.full((etp * ep, e), cap, dtype=torch.long, device=x_TH.device)
                row_map = build_row_map(send_key, T, K, E, capacity=cap)
                rows = permute(x_TH, row_map)
            else:
                counts_E = group_counts(key, E)
                exchange = ep * etp > 1 or routing.keep_TK is not None
                pad = routing.pad_multiple
                if exchange:  # the layer's one exchange of split sizes, launched first: the argsort overlaps it
                    gathered, work = gather_counts(counts_E, self.counts_group, async_op=True)
                # dropless: all T*K copies are rows, known without the counts (padded: not before the counts)
                row_map = (build_row_map(send_key, T, K, E, num_rows=T * K)
                           if routing.keep_TK is None and pad is None else None)
                if row_map is not None:  # permute while the counts are in flight
                    rows = permute(x_TH, row_map)
                if not exchange and pad is not None:   # padded local rows: the counts on the host (one sync)
                    mine = counts_E.tolist()
                    row_map = build_padded_row_map(send_key, T, K, E, mine, pad)
                    rows = permute(x_TH, row_map)
                    mine, recv, chunk_counts = [row_map.num_rows], None, row_map.counts_G.view(1, E)
                elif not exchange:
                    mine, recv = [T * K], None
                    chunk_counts = counts_E.view(1, E)
                else:
                    if work is not None:
                        work.wait()
                    # etp_ep ranks are ep-major (ep_rank * etp + etp_rank): [ep, etp, E] -> [etp, ep, E]
                    all_counts = gathered.view(ep, etp, E).transpose(0, 1)
                    host = all_counts.tolist()  # the dispatch's one host synchronisation
                    mine = host[self.etp_rank][self.ep_rank]
                    recv = [[row[local] for row in per_etp] for per_etp in host]
                    chunk_counts = all_counts[:, :, local].reshape(etp * ep, e)
                    if pad is not None:   # every (destination, expert) chunk padded: the sums stay multiples
                        order = [(g % ep) * e + g // ep for g in range(E)] if self.chunked else range(E)
                        row_map = build_padded_row_map(send_key, T, K, E, [mine[i] for i in order], pad)
                        rows = permute(x_TH, row_map)
                        mine = pad_counts(mine, pad)
                        recv = [[pad_counts(row, pad) for row in per_etp] for per_etp in recv]
                        chunk_counts = (chunk_counts + pad - 1).div(pad, rounding_mode="floor") * pad
                if row_map is None:
                    row_map = build_row_map(send_key, T, K, E, num_rows=sum(mine))
                    rows = permute(x_TH, row_map)
        if recv is None:
            plan, etp_sizes = ExchangePlan((row_map.num_rows,), (row_map.num_rows,)), (row_map.num_rows,)
        else:
            plan, etp_sizes = self._plan(mine, recv)
        prep = AllToAllPrep(row_map=row_map, plan=plan, etp_sizes=etp_sizes, chunk_counts=chunk_counts, recv=recv,
                            num_tokens=T)
        if not with_probs:
            return (rows,), prep
        with self._phase("permute"):   # each row's prob travels beside it ([N], fp32 from the router)
            probs_N = permute_probs(routing.probs_TK, row_map)
        return (rows, probs_N), prep

    def dispatch_exchange(self, prep: AllToAllPrep) -> AllToAllExchange:
        return prep.plan.exchange(self.ep_group, self.fp8)

    def finish_dispatch(self, received: tuple[Tensor, ...], meta: None, prep: AllToAllPrep,
                        ) -> Dispatched[AllToAllHandle]:
        e, ep, etp, recv = self.num_local_experts, self.ep, self.etp, prep.recv
        with self._phase("communicate"):
            got = [all_gather_uneven(t, list(prep.etp_sizes), self.etp_group) for t in received]
        with self._phase("sort"):
            if not self.chunked:  # chunked: rows arrive expert-major already
                got = [sort_chunks(t, prep.chunk_counts) for t in got]
            per_expert = prep.chunk_counts.sum(0)
            per_expert_host = None if recv is None else tuple(
                sum(recv[t][src][j] for t in range(etp) for src in range(ep)) for j in range(e))
        rows, *probs = got
        handle = AllToAllHandle(num_tokens=prep.num_tokens, num_rows=rows.shape[0], row_map=prep.row_map,
                                plan=prep.plan, etp_sizes=prep.etp_sizes, chunk_counts=prep.chunk_counts)
        return Dispatched(rows, per_expert, handle, per_expert_host, probs_N=probs[0] if probs else None)

    # -- combine: prepare (unsort, etp reduce-scatter) -> exchange (all-to-all back) -> finish (unpermute) ----
    def prepare_combine(self, expert_out_NH: Tensor, handle: AllToAllHandle) -> tuple[Tensor, ...]:
        self._check_combine(expert_out_NH, handle, AllToAllHandle)
        rows = expert_out_NH
        if not self.chunked:
            with self._phase("sort"):
                rows = sort_chunks(rows, handle.chunk_counts.t())
        with self._phase("communicate"):
            if self.etp > 1:
                # the etp shards' partial FFN sums add up in fp32 (the combine's fp32 island, as Megatron-Core
                # reduce-scatters them in its probs' fp32), rounded back for the token exchange
                dtype = rows.dtype
                rows = reduce_scatter_uneven(rows.to(combine_dtype(dtype)), list(handle.etp_sizes), self.etp_group,
                                             self.etp_rank).to(dtype)
            return (rows,)

    def combine_exchange(self, handle: AllToAllHandle) -> AllToAllExchange:
        return handle.plan.exchange(self.ep_group).reverse()

    def finish_combine(self, received: tuple[Tensor, ...], handle: AllToAllHandle) -> Tensor:
        with self._phase("unpermute"):
            # each token's k returned copies, weighted by the experts, summed here
            return unpermute(received[0], handle.row_map)

