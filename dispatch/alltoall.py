"""All-to-all dispatcher over ep, with an all-gather / reduce-scatter inside etp (and the local one).

Dispatch on rank (etp t, ep r):

1. permute:     this rank's kept copies -> rows sorted by global expert (hence by destination ep rank)
2. counts:      all-gather the [E] per-expert counts over ep then etp -> [etp, ep, E] (two tiny
                collectives, then the dispatch's one host synchronisation: ``.tolist()`` of those
                counts, because the exchange needs its split sizes on the host)
3. all-to-all:  uneven, over ep (asynchronous: ``dispatch_start`` returns while it is in flight)
4. etp gather:  every etp rank receives every other's rows -> [etp src, ep src, e_local] chunks
5. sort:        regroup chunks to [e_local, etp src, ep src] (expert-major)

Combine runs the mirror image: unsort, reduce-scatter over etp (sums the experts' partial
FFN outputs), reverse all-to-all, unpermute (sum of each token's K copies).

Host synchronisations per MoE layer (forward and backward together, proved by
tests/dispatch/test_host_sync.py): dropless or unpadded capacity mode exactly one (the split
sizes; the backward reuses them from the handle); padded mode none; the local dispatcher none
when dropless (N = T*K is known) or padded, one in unpadded capacity mode (the kept count).

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

from moefold.dispatch.base import Dispatched, DispatchHandle, PendingDispatch, PhaseTimer, TokenDispatcher
from moefold.dispatch.exchange import chunked_all_to_all, chunked_all_to_all_async
from moefold.dispatch.fp8_exchange import fp8_all_to_all_async, fp8_chunked_all_to_all_async
from moefold.dispatch.permutation import (
    RowMap,
    build_row_map,
    group_counts,
    mask_groups,
    permute,
    permute_probs,
    sort_chunks,
    unpermute,
)
from moefold.moe.routing import Routing
from moefold.parallel.comm import all_gather_sequence, all_to_all, all_to_all_async, reduce_scatter_sequence
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
    # all_gather_single is all_gather_into_tensor's newer name (the old one warns on recent torch)
    work = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, flat, group=group, async_op=async_op)
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
class AllToAllHandle(DispatchHandle):
    """row_map: this rank's permutation; send/recv splits of the ep all-to-all (rows per rank);
    etp_sizes: rows each etp rank contributed to the gather; chunk_counts: [etp*ep, e_local] chunk
    sizes (device); chunk_send / chunk_recv: per local expert splits when the exchange is chunked
    (rows already expert-major, no sort), else None."""

    row_map: RowMap
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    etp_sizes: tuple[int, ...]
    chunk_counts: Tensor
    chunk_send: tuple[tuple[int, ...], ...] | None = None
    chunk_recv: tuple[tuple[int, ...], ...] | None = None


class AllToAllDispatcher(TokenDispatcher):
    """Uneven all-to-all over ``ep_group``, all-gather / reduce-scatter over ``etp_group``.

    Groups are explicit; ``None`` (or size 1) means no communication along that dimension.
    With etp = 1 and at most ``max_chunked_experts`` local experts, the exchange is one
    all-to-all per local expert landing rows directly in expert-major order (``dispatch.exchange``),
    which saves the two sort copies; beyond that, one all-to-all plus ``sort_chunks``.
    ``fp8``: the token rows travel as e4m3 with their scales (``dispatch.fp8_exchange``).
    """

    name = "alltoall"

    def __init__(self, num_experts: int, ep_group: Group = None, etp_group: Group = None,
                 timer: PhaseTimer | None = None, max_chunked_experts: int = 8, fp8: bool = False):
        super().__init__(num_experts, ep_group, etp_group, timer)
        self._send_rows, self._send_rows_chunked = ((fp8_all_to_all_async, fp8_chunked_all_to_all_async) if fp8
                                                    else (all_to_all_async, chunked_all_to_all_async))
        if max_chunked_experts < 0:
            raise ValueError(f"max_chunked_experts={max_chunked_experts} must be >= 0 (0 disables chunking)")
        e = self.num_local_experts
        self.chunked = self.etp == 1 and self.ep > 1 and 1 < e <= max_chunked_experts

    def _send_key(self, key: Tensor) -> Tensor:
        """Chunked exchange: order the send rows [local expert index j x destination rank]."""
        E, e, ep = self.num_experts, self.num_local_experts, self.ep
        return torch.where(key < E, (key % e) * ep + key.div(e, rounding_mode="floor"), key)

    # -- dispatch --------------------------------------------------------------------------
    def dispatch_start(self, x_TH: Tensor, routing: Routing) -> PendingDispatch:
        self._check(x_TH, routing)
        T, K = routing.probs_TK.shape
        E, e, ep, etp = self.num_experts, self.num_local_experts, self.ep, self.etp
        local = slice(self.local_expert_offset, self.local_expert_offset + e)
        with self._phase("permute"):
            key = mask_groups(routing.expert_ids_TK, E, routing.keep_TK)
            counts_E = None
            if routing.pad_to_capacity:
                cap = int(routing.capacity)
                mine = [cap] * E
                recv = [[[cap] * e for _ in range(ep)] for _ in range(etp)]
                chunk_counts = torch.full((etp * ep, e), cap, dtype=torch.long, device=x_TH.device)
                row_map = build_row_map(self._send_key(key) if self.chunked else key, T, K, E, capacity=cap)
                rows = permute(x_TH, row_map)
            else:
                counts_E = group_counts(key, E)
                exchange = ep * etp > 1 or routing.keep_TK is not None
                if exchange:  # launched first: the argsort below overlaps it
                    all_counts, work = gather_counts(counts_E, self.ep_group, async_op=True)
                send_key = self._send_key(key) if self.chunked else key
                # dropless: all T*K copies are rows, known without the counts
                row_map = build_row_map(send_key, T, K, E, num_rows=T * K) if routing.keep_TK is None else None
                if row_map is not None:  # permute while the counts are in flight
                    rows = permute(x_TH, row_map)
                if not exchange:
                    mine, recv = [T * K], None
                    chunk_counts = counts_E.view(1, E)
                else:
                    if work is not None:
                        work.wait()
                    all_counts = gather_counts(all_counts, self.etp_group)
                    host = all_counts.tolist()  # the dispatch's one host synchronisation
                    mine = host[self.etp_rank][self.ep_rank]
                    recv = [[row[local] for row in per_etp] for per_etp in host]
                    chunk_counts = all_counts[:, :, local].reshape(etp * ep, e)
                if row_map is None:
                    row_map = build_row_map(send_key, T, K, E, num_rows=sum(mine))
                    rows = permute(x_TH, row_map)
            probs = permute_probs(routing.probs_TK.float(), row_map)
        if recv is None:
            send = recv_splits = etp_sizes = (row_map.num_rows,)
        else:
            send = tuple(sum(mine[s * e:(s + 1) * e]) for s in range(ep))
            recv_splits = tuple(sum(recv[self.etp_rank][s]) for s in range(ep))
            etp_sizes = tuple(sum(sum(c) for c in recv[t]) for t in range(etp))
        chunk_send = chunk_recv = None
        with self._phase("communicate"):
            if self.chunked:
                chunk_send = tuple(tuple(mine[d * e + j] for d in range(ep)) for j in range(e))
                chunk_recv = tuple(tuple(recv[0][s][j] for s in range(ep)) for j in range(e))
                pending_rows = self._send_rows_chunked(rows, chunk_recv, chunk_send, self.ep_group)
                # probs are tiny: one exchange in [destination x expert] order, regrouped on both sides.
                # The chunk sizes come from device tensors: one built from the host lists would be a
                # blocking host->device copy (a stream synchronisation on CUDA).
                if counts_E is None:  # padded: every chunk is `capacity` rows
                    send_counts_je = torch.full((e, ep), int(routing.capacity), dtype=torch.long, device=x_TH.device)
                else:
                    send_counts_je = counts_E.view(ep, e).t()  # [local expert, destination]
                probs = sort_chunks(probs, send_counts_je)
                probs_recv_counts = chunk_counts.view(etp, ep, e)[0]  # [source, expert]
                pending_probs = all_to_all_async(probs, list(recv_splits), list(send), self.ep_group)
            else:
                pending_rows = self._send_rows(rows, list(recv_splits), list(send), self.ep_group)
                pending_probs = all_to_all_async(probs, list(recv_splits), list(send), self.ep_group)

        def finish() -> Dispatched:
            with self._phase("communicate"):
                got_rows, got_probs = pending_rows.wait(), pending_probs.wait()
                got_rows = all_gather_uneven(got_rows, list(etp_sizes), self.etp_group)
                got_probs = all_gather_uneven(got_probs, list(etp_sizes), self.etp_group)
            with self._phase("sort"):
                if self.chunked:  # rows arrive expert-major already
                    got_probs = sort_chunks(got_probs, probs_recv_counts)
                else:
                    got_rows = sort_chunks(got_rows, chunk_counts)
                    got_probs = sort_chunks(got_probs, chunk_counts)
                per_expert = chunk_counts.sum(0)
                per_expert_host = None if recv is None else tuple(
                    sum(recv[t][src][j] for t in range(etp) for src in range(ep)) for j in range(e))
            handle = AllToAllHandle(num_tokens=T, num_rows=got_rows.shape[0], row_map=row_map, send_splits=send,
                                    recv_splits=recv_splits, etp_sizes=etp_sizes, chunk_counts=chunk_counts,
                                    chunk_send=chunk_send, chunk_recv=chunk_recv)
            return Dispatched(got_rows, got_probs, per_expert, handle, per_expert_host)

        return PendingDispatch(finish)

    # -- combine ---------------------------------------------------------------------------
    def combine(self, expert_out_NH: Tensor, handle: DispatchHandle) -> Tensor:
        self._check_combine(expert_out_NH, handle, AllToAllHandle)
        assert isinstance(handle, AllToAllHandle)
        if handle.chunk_send is not None:
            with self._phase("communicate"):
                rows = chunked_all_to_all(expert_out_NH, handle.chunk_send, handle.chunk_recv, self.ep_group)
        else:
            with self._phase("sort"):
                rows = sort_chunks(expert_out_NH, handle.chunk_counts.t())
            with self._phase("communicate"):
                rows = reduce_scatter_uneven(rows, list(handle.etp_sizes), self.etp_group, self.etp_rank)
                rows = all_to_all(rows, list(handle.send_splits), list(handle.recv_splits), self.ep_group)
        with self._phase("unpermute"):
            return unpermute(rows, handle.row_map)


class LocalDispatcher(AllToAllDispatcher):
    """ep = etp = 1: permute into expert-major rows and back, no communication.

    Dropless or padded it never synchronises with the host (N = T*K, or E * capacity, is known);
    unpadded capacity mode reads the kept count once. Its ``tokens_per_expert_host`` is then None
    when dropless: the counts stay on the device (a backend that needs them on the host reads them).
    """

    name = "local"

    def __init__(self, num_experts: int, timer: PhaseTimer | None = None, fp8: bool = False):
        super().__init__(num_experts, None, None, timer, fp8=fp8)
