"""A CPU stand-in for DeepEP V2's ``deep_ep.ElasticBuffer``, for protocol tests (gloo underneath).

It checks the *protocol*, not DeepEP's kernels: ``ElasticBuffer``, ``EPHandle`` and ``EventOverlap`` have the
signatures of DeepEP 2.1.0 (``deep_ep/buffers/elastic.py``, ``deep_ep/utils/event.py`` on main at dd758ca: the
argument names, defaults and return arities), and the data moves over torch.distributed with the semantics
DeepEP's own tests check (``tests/elastic/test_ep.py``, reference ``deep_ep/utils/refs.py``):

- ``dispatch`` with ``do_expand=True``: every (token, top-k) selection of an expert on this rank becomes one row,
  grouped by local expert, each expert's block starting at a multiple of ``expert_alignment``;
  ``handle.psum_num_recv_tokens_per_expert[i]`` is expert i's aligned start plus its real count; the top-k
  weights arrive one per row (``recv_topk_weights`` 1-D). The order of the rows inside an expert is not the
  source order (DeepEP's is whatever its warps produce; this stand-in reverses it, so code that assumes an
  order fails). FP8 input is a ``(data, scales)`` tuple and arrives as one.
- ``do_cpu_sync=False``: the received tensors are allocated for the worst case (``num_ranks *
  num_max_tokens_per_rank * min(num_topk, num_local_experts)`` rows plus alignment, buffer.hpp:1066-1070) and
  ``num_recv_tokens_per_expert_list`` is empty; rows past the last expert's and unzeroed padding hold NaN (the
  real ones hold whatever ``torch.empty`` left), so a consumer that reads them is caught. ``do_cpu_sync=True``
  allocates exactly and makes the host wait for the counts: modelled by one read of a device tensor outside
  ``HOST_WORK`` (so ``HostSyncCounter`` counts it, as it would count a CUDA host wait).
- a cached ``handle``: the same layout again (backward), ``topk_weights`` optional;
- ``combine``: per token, the sum of its rows on every rank (without weights; in fp32, rounded to bf16 after the
  reduction within a rank as with ``allow_multiple_reduction``), and the 1-D weights reduced back to
  ``[num_tokens, num_topk]``.
- asynchrony: with ``async_with_compute_stream=True`` the outputs read NaN (ids -7) until the returned
  ``EventOverlap.current_stream_wait()``; without it the compute stream has waited already (event None).

The buffer arithmetic (sizes, the SM estimate) is in deepep_elastic_layout.py, the returned objects (events,
``EPHandle``) in deepep_elastic_events.py, torch's NCCL communicator that DeepEP reuses (null, and refused, for a
group that has run no collective when DeepEP first asks) in deepep_elastic_comm.py. Host work of the stand-in
itself runs under ``HOST_WORK`` (a test replaces it with a sync counter's ``paused``: DeepEP's own bookkeeping
happens in its C++). ``NUM_NVL_RANKS`` is the physical NVLink domain (NCCL's LSA team): with 2, a 4-rank group spans
two "nodes", so hybrid mode (``allow_hybrid_mode=True``) has 2 scale-out x 2 scale-up ranks and direct mode 1 x 4,
with the buffer sizes DeepEP computes for each.

Preconditions: every check DeepEP makes on what a caller passes is made here too, citing its line (``elastic.py``
is ``deep_ep/buffers/elastic.py``, ``buffer.hpp`` ``csrc/elastic/buffer.hpp``, ``dispatch.hpp``
``csrc/kernels/elastic/dispatch.hpp``, ``layout.cuh`` / ``dispatch.cuh`` / ``combine_reduce_epilogue.cuh``
under ``deep_ep/include/deep_ep/``, ``envs.py`` ``deep_ep/utils/envs.py``). A host assert (``EP_HOST_ASSERT``)
raises ``RuntimeError("Assertion exception (FILE:LINE): COND")`` as DeepEP's ``EPException``; a Python assert
raises ``AssertionError``; a failed ``static_assert`` in a JIT-compiled kernel raises DeepEP's "NVCC compilation
failed" host assert. ``PRECONDITIONS`` lists them (tests/test_standins.py checks each).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from tests.dispatch import deepep_elastic_comm
from tests.dispatch.deepep_elastic_events import EPHandle, EventHandle, EventOverlap
from tests.dispatch.deepep_elastic_layout import (
    ALIGNMENT,
    NUM_DEVICE_SMS,
    align,
    calculate_buffer_size,
    combine_bytes,
    dispatch_bytes,
    domains,
    theoretical_num_sms,
)
from tests.dispatch.deepep_elastic_layout import host_assert as _host_assert

HOST_WORK: Callable[[], AbstractContextManager] = nullcontext
NUM_NVL_RANKS = 8          # physical NVLink domain size (ncclTeamLsa); tests set 2 to make groups span "nodes"
topk_idx_t = torch.int64

# What the real library rejects and the stand-in with it: (what, file:line at DeepEP main dd758ca).
PRECONDITIONS: tuple[tuple[str, str], ...] = (
    ("deterministic algorithms with fill_uninitialized_memory: dispatch", "elastic.py:924 -> envs.py:189"),
    ("deterministic algorithms with fill_uninitialized_memory: combine", "elastic.py:1083 -> envs.py:189"),
    ("QPs within the allocated ones: dispatch", "elastic.py:930"),
    ("QPs within the allocated ones: combine", "elastic.py:1088"),
    ("a cached handle without topk_idx", "elastic.py:938"),
    ("no CPU sync with a cached handle", "elastic.py:939"),
    ("a cached handle's experts, alignment and max tokens", "elastic.py:947-948"),
    ("num_sms > 0", "buffer.hpp:728"),
    ("zero padding only with do_expand", "buffer.hpp:731"),
    ("x contiguous: dispatch", "buffer.hpp:754"),
    ("hidden bytes a multiple of 16: dispatch", "buffer.hpp:755"),
    ("num_tokens <= num_max_tokens_per_rank: dispatch", "buffer.hpp:756"),
    ("FP8 scales of 4 bytes", "buffer.hpp:767"),
    ("topk_idx of topk_idx_t", "buffer.hpp:777"),
    ("topk_weights contiguous: dispatch", "buffer.hpp:785"),
    ("recv stats int32 with one count per local expert", "buffer.hpp:795 (data_ptr<int> at 796)"),
    ("no recv stats with a cached handle", "dispatch.hpp:168"),
    ("num_experts a multiple of the ranks", "buffer.hpp:805"),
    ("at most 2048 experts, 256 per rank", "layout.cuh:39-40 (WorkspaceLayout, built at buffer.hpp:969)"),
    ("hidden bytes a multiple of 32 (TMA)", "layout.cuh:198"),
    ("the buffer holds the dispatch", "buffer.hpp:963-966"),
    ("num_sms within the device's SMs", "buffer.hpp:979"),
    ("num_topk <= 32", "dispatch.cuh:93 (static_assert in the JIT-built kernel: compiler.hpp:239)"),
    ("bf16 combine input", "buffer.hpp:1203"),
    ("hidden bytes a multiple of 16: combine", "buffer.hpp:1204"),
    ("topk_weights fp32: combine", "buffer.hpp:1234"),
    ("the buffer holds the combine", "buffer.hpp:1254-1256"),
    ("previous_event needs allocate_on_comm_stream", "buffer.hpp:539-540"),
    ("buffer bytes a positive multiple of 2 MiB", "buffer.hpp:98"),
    ("size hint: positive tokens and hidden", "buffer.hpp:657"),
    ("destroy() needs explicitly_destroy=True", "elastic.py:373"),
    ("num_scaleout_topk == 0 in the SM estimate", "elastic.py:757"),
    ("torch's communicator formed: size hint", "comm.py:57-64 -> nccl.cu:51 (deepep_elastic_comm.py)"),
    ("torch's communicator formed: ElasticBuffer", "comm.py:57-64 -> nccl.cu:84 (deepep_elastic_comm.py)"),
)


def check_torch_deterministic() -> None:
    """envs.py:183-189: deterministic algorithms and fill_uninitialized_memory must not both be on."""
    assert not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory)


def _garbage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What ``torch::empty`` may hold: NaN for floating dtypes (-7 for integers)."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=torch.float32).to(dtype)
    return torch.full(shape, -7, dtype=dtype)


class ElasticBuffer:
    """DeepEP V2 ``deep_ep.ElasticBuffer``: the expert-parallel dispatch and combine of elastic.py."""

    instances: ClassVar[list[ElasticBuffer]] = []   # every buffer made in this process (the tests count them)
    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def __init__(self, group: dist.ProcessGroup, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        self.group, self.rank_idx, self.num_ranks = group, group.rank(), group.size()
        self.allow_hybrid_mode, self.allow_multiple_reduction = allow_hybrid_mode, allow_multiple_reduction
        self.prefer_overlap_with_compute, self.deterministic = prefer_overlap_with_compute, deterministic
        assert num_cpu_bytes == 0, "the stand-in models GPU buffers only"
        deepep_elastic_comm.comm_handle(group)   # elastic.py:301: torch's communicator, taken and cached
        if num_bytes is None:
            num_bytes = calculate_buffer_size(self.num_ranks, NUM_NVL_RANKS, num_max_tokens_per_rank, hidden,
                                              num_topk, use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)
        deepep_elastic_comm.require_formed(group, "ElasticBuffer")   # nccl.cu:51 / :84 read the communicator
        _host_assert(num_bytes > 0 and num_bytes % ALIGNMENT == 0, "buffer.hpp:98",
                     "num_buffer_bytes > 0 and num_buffer_bytes % symmetric::kNumAlignmentBytes == 0")
        self.num_bytes, self.num_max_tokens_per_rank = num_bytes, num_max_tokens_per_rank
        if num_allocated_qps == 0:   # elastic.py:328-334 (no fast RDMA atomics on this machine)
            num_allocated_qps = 129 if allow_hybrid_mode else 17
        self.num_allocated_qps = num_allocated_qps
        self.explicitly_destroy, self.runtime = explicitly_destroy, object()
        self.num_scaleout_ranks, self.num_scaleup_ranks, self.num_rdma_ranks, self.num_nvlink_ranks = domains(
            self.num_ranks, NUM_NVL_RANKS, allow_hybrid_mode)
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        dist.barrier(group=group)   # elastic.py:364-367: a collective
        ElasticBuffer.instances.append(self)

    def destroy(self) -> None:
        """elastic.py:369-378: only with ``explicitly_destroy``; collective (barrier with CPU sync, buffer.hpp:156)."""
        assert self.explicitly_destroy
        if self.runtime is not None:
            dist.barrier(group=self.group)
            self.runtime = None

    @property
    def destroyed(self) -> bool:
        return self.runtime is None

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """elastic.py:403-406: ``calculate_elastic_buffer_size(get_nccl_comm_handle(group).get(), ...)``: the
        handle is taken (and cached) first; buffer.hpp:657 asserts the sizes before reading it (nccl.cu:51)."""
        deepep_elastic_comm.comm_handle(group)
        size = calculate_buffer_size(group.size(), NUM_NVL_RANKS, num_max_tokens_per_rank, hidden, num_topk,
                                     use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)
        deepep_elastic_comm.require_formed(group, "ElasticBuffer.get_buffer_size_hint")
        return size

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        dist.barrier(group=self.group)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """elastic.py:728-834 (``deepep_elastic_layout.theoretical_num_sms``)."""
        assert num_scaleout_topk == 0
        return theoretical_num_sms(num_experts, num_topk, self.num_ranks, self.num_scaleout_ranks,
                                   self.num_scaleup_ranks, self.num_rdma_ranks, self.num_nvlink_ranks,
                                   self.prefer_overlap_with_compute, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 8 + 1)
        return min(num_qps, self.num_allocated_qps)

    # -- helpers --------------------------------------------------------------------------------------------
    def _record(self, name: str, **kw: Any) -> None:
        assert self.runtime is not None, "'NoneType' object has no attribute (the buffer was destroyed)"
        ElasticBuffer.calls.append((name, kw))

    def _stream_control(self, previous_event: Any, allocate_on_comm_stream: bool) -> None:
        assert previous_event is None or isinstance(previous_event, EventHandle), type(previous_event)
        if previous_event is not None:
            _host_assert(allocate_on_comm_stream, "buffer.hpp:540", "allocate_on_comm_stream")

    def _finish(self, results: list[torch.Tensor | None], async_with_compute_stream: bool
                ) -> tuple[list[torch.Tensor | None], EventOverlap]:
        if not async_with_compute_stream:
            return results, EventOverlap(None)
        event, outs = EventHandle(), []
        for real in results:
            if real is None:
                outs.append(None)
                continue
            out = _garbage(tuple(real.shape), real.dtype)

            def complete(out: torch.Tensor = out, real: torch.Tensor = real) -> None:
                with torch.no_grad():
                    out.copy_(real)

            event.on_complete.append(complete)
            outs.append(out)
        return outs, EventOverlap(event)

    def _exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows to ranks (``send[r]`` to rank r), received in source-rank order; bytes travel (fp8 as uint8)."""
        raw = rows.view(torch.uint8) if rows.dtype in (torch.float8_e4m3fn, torch.bfloat16) else rows
        out = raw.new_empty((sum(recv), *raw.shape[1:]))
        dist.all_to_all_single(out, raw.contiguous(), recv, send, group=self.group)
        return out.view(rows.dtype) if raw is not rows else out

    # -- dispatch --------------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms: int = 0,
                 num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False, handle=None,
                 do_handle_copy: bool = True, do_cpu_sync=None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        check_torch_deterministic()                                                          # elastic.py:924
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[1]
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms
        num_qps = self.get_theoretical_num_qps(num_sms) if num_qps == 0 else num_qps
        assert num_qps <= self.num_allocated_qps, 'Allocated QPs are not enough'           # elastic.py:930
        x, sf = x if isinstance(x, tuple) else (x, None)
        cached = handle is not None
        if cached:
            assert topk_idx is None                                                          # elastic.py:938
            assert do_cpu_sync is None or not do_cpu_sync, 'Cannot do CPU sync with cached handle'
            topk_idx = handle.topk_idx
            num_max_tokens_per_rank = handle.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
                else num_max_tokens_per_rank
            num_experts = handle.num_experts if num_experts is None else num_experts
            expert_alignment = handle.expert_alignment if expert_alignment is None else expert_alignment
            do_cpu_sync = False
            assert (num_experts, expert_alignment, num_max_tokens_per_rank) == \
                (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)  # elastic.py:947
        num_max_tokens_per_rank = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
            else num_max_tokens_per_rank
        expert_alignment = 1 if expert_alignment is None else expert_alignment
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        self._record("dispatch", cached=cached, do_cpu_sync=do_cpu_sync, do_expand=do_expand,
                     do_zero_padding=do_zero_padding, num_sms=num_sms, expert_alignment=expert_alignment,
                     async_with_compute_stream=async_with_compute_stream, fp8=sf is not None,
                     stats=cumulative_local_expert_recv_stats is not None, with_weights=topk_weights is not None,
                     previous_event=previous_event)
        # buffer.hpp:702-1177
        _host_assert(num_sms > 0, "buffer.hpp:728", "num_sms > 0")
        _host_assert(not do_zero_padding or do_expand, "buffer.hpp:731", "not do_zero_padding or do_expand")
        num_tokens, hidden = x.shape
        R = self.num_ranks
        _host_assert(x.is_contiguous(), "buffer.hpp:754", "x.is_cuda() and x.is_contiguous()")
        _host_assert((hidden * x.element_size()) % 16 == 0, "buffer.hpp:755",
                     "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        _host_assert(num_tokens <= num_max_tokens_per_rank, "buffer.hpp:756", "num_tokens <= num_max_tokens_per_rank")
        assert x.dtype in (torch.bfloat16, torch.float8_e4m3fn), \
            f"x must be torch.bfloat16, or torch.float8_e4m3fn with scales (elastic.py:882-885), got {x.dtype}"
        num_sf_packs = 0
        if sf is not None:
            _host_assert(sf.shape[0] == num_tokens, "buffer.hpp:765", "num_tokens == num_tokens_")
            _host_assert(sf.element_size() == 4, "buffer.hpp:767", "sf->element_size() == sizeof(sf_pack_t)")
            num_sf_packs = sf.shape[1]
        _host_assert(topk_idx.shape[0] == num_tokens, "buffer.hpp:776", "num_tokens == num_tokens_")
        _host_assert(topk_idx.dtype == topk_idx_t, "buffer.hpp:777",
                     "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value")
        _host_assert(topk_idx.is_contiguous(), "buffer.hpp:778", "topk_idx.is_cuda() and topk_idx.is_contiguous()")
        if topk_weights is not None:
            _host_assert(tuple(topk_weights.shape[:1]) == (num_tokens,), "buffer.hpp:784", "num_tokens == num_tokens__")
            _host_assert(topk_weights.is_contiguous(), "buffer.hpp:785",
                         "topk_weights->is_cuda() and topk_weights->is_contiguous()")
            if topk_weights.dtype != torch.float32:   # data_ptr<float>() (buffer.hpp:786)
                raise RuntimeError(f"expected scalar type Float but found {topk_weights.dtype}")
        e = num_experts // R
        if cumulative_local_expert_recv_stats is not None:
            stats = cumulative_local_expert_recv_stats
            _host_assert(stats.dim() == 1 and stats.is_contiguous() and stats.shape[0] == e, "buffer.hpp:795",
                         "num_local_experts == num_local_experts_")
            if stats.dtype != torch.int32:   # data_ptr<int>() (buffer.hpp:796)
                raise RuntimeError(f"expected scalar type Int but found {stats.dtype}")
        _host_assert(num_experts % R == 0, "buffer.hpp:805", "num_experts % nccl_context->num_ranks == 0")
        _host_assert(num_experts <= 2048 and e <= 256, "layout.cuh:39-40",
                     "num_experts <= kNumMaxExperts and num_experts_per_rank <= kNumMaxExpertsPerRank")
        need = dispatch_bytes(num_max_tokens_per_rank, hidden, num_sf_packs, num_topk, x.element_size(),
                              self.num_scaleout_ranks, self.num_scaleup_ranks,
                              self.num_scaleup_ranks == self.num_nvlink_ranks)
        _host_assert(need <= self.num_bytes, "buffer.hpp:963-966", "get_dispatch_buffer_size(...) <= num_buffer_bytes")
        _host_assert(num_sms <= NUM_DEVICE_SMS, "buffer.hpp:979", "num_sms <= jit::device_runtime->get_num_sms()")
        if num_topk > 32:
            raise RuntimeError("Assertion exception (csrc/jit/compiler.hpp:239): false and \"NVCC compilation "
                               "failed\" (dispatch.cuh:93: static_assert(kNumTopk <= 32, \"Insufficient lanes\"))")
        if cached:
            _host_assert(cumulative_local_expert_recv_stats is None, "csrc/kernels/elastic/dispatch.hpp:168",
                         "cumulative_local_expert_recv_stats == nullptr")
        self._stream_control(previous_event, allocate_on_comm_stream)
        if not do_expand:
            raise NotImplementedError("the stand-in models the expanded layout (do_expand=True) only")

        with HOST_WORK():
            route = handle._route if cached else self._route(topk_idx, e, num_max_tokens_per_rank, expert_alignment,
                                                             do_cpu_sync, num_topk)
            send, recv, send_index, order, slot_rows = (route[k] for k in ("send", "recv", "send_index", "order",
                                                                          "slot_rows"))
            # what travels: each token once per destination rank (the real kernel also carries the routing)
            data = self._exchange(x[send_index], send, recv)
            got_sf = self._exchange(sf[send_index].contiguous(), send, recv) if sf is not None else None
            got_w = self._exchange(topk_weights[send_index].float().contiguous(), send, recv) \
                if topk_weights is not None else None
            n = route["alloc"]
            recv_x = _garbage((n, hidden), x.dtype)
            recv_sf = _garbage((n, num_sf_packs), sf.dtype) if sf is not None else None
            recv_w = _garbage((n,), torch.float32) if topk_weights is not None else None
            if do_zero_padding:
                for t in (recv_x, recv_sf, recv_w):
                    if t is not None:
                        t[route["padding"]] = 0
            rows, ks = order   # the expanded rows in their (scrambled) order: received token, top-k slot
            recv_x[slot_rows] = data[rows]
            if recv_sf is not None:
                recv_sf[slot_rows] = got_sf[rows]
            if recv_w is not None:
                recv_w[slot_rows] = got_w[rows, ks]
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats += route["unaligned"].to(torch.int32)
        if cached:
            new_handle = handle
        else:
            if do_cpu_sync:   # buffer.hpp:1017-1064: the host spins on the counts the kernel writes
                route["per_expert_list"] = route["aligned"].tolist()
            with HOST_WORK():
                new_handle = self._handle(route, topk_idx, num_experts, expert_alignment, num_max_tokens_per_rank,
                                          num_sms, do_cpu_sync, do_handle_copy, num_topk)
        (recv_x, recv_sf, recv_w), event = self._finish([recv_x, recv_sf, recv_w], async_with_compute_stream)
        out_x = (recv_x, recv_sf) if sf is not None else recv_x
        return out_x, None, recv_w, new_handle, event

    def _route(self, topk_idx: torch.Tensor, e: int, tokens_max: int, alignment: int, cpu_sync: bool,
               num_topk: int) -> dict[str, Any]:
        """Who sends what where, and where each received selection lands in the expanded layout."""
        R, T = self.num_ranks, topk_idx.shape[0]
        dest = torch.where(topk_idx >= 0, topk_idx.div(e, rounding_mode="floor"), -1)
        in_rank = torch.stack([(dest == r).any(1) for r in range(R)], 1) if T else torch.zeros(0, R, dtype=torch.bool)
        send_index = torch.cat([torch.nonzero(in_rank[:, r]).reshape(-1) for r in range(R)]) if T else \
            torch.zeros(0, dtype=torch.long)
        dest_rank = torch.cat([torch.full((int(in_rank[:, r].sum()),), r) for r in range(R)]) if T else send_index
        send = in_rank.sum(0).tolist()
        counts = torch.tensor(send, dtype=torch.int64)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        recv = got.tolist()
        begin = (dest_rank * e).unsqueeze(1)
        idx = topk_idx[send_index]
        local = torch.where((idx >= begin) & (idx < begin + e), idx - begin, -1)
        src = (self.rank_idx * tokens_max + send_index).to(torch.int32)
        recv_local = self._exchange(local, send, recv)
        recv_src = self._exchange(src, send, recv)
        n_recv = recv_local.shape[0]
        # expanded layout: expert j's selections, in reversed source order, from its aligned start
        unaligned = torch.tensor([int((recv_local == j).sum()) for j in range(e)], dtype=torch.int64)
        aligned = torch.tensor([align(int(c), alignment) for c in unaligned], dtype=torch.int64)
        starts = torch.cumsum(aligned, 0) - aligned
        slots = torch.full((n_recv, num_topk), -1, dtype=torch.int64)
        rows_l, ks_l, slot_l, padding = [], [], [], []
        for j in range(e):
            r_j, k_j = torch.nonzero(recv_local == j, as_tuple=True)
            r_j, k_j = r_j.flip(0), k_j.flip(0)
            pos = int(starts[j]) + torch.arange(r_j.numel())
            slots[r_j, k_j] = pos
            rows_l.append(r_j)
            ks_l.append(k_j)
            slot_l.append(pos)
            padding.append(torch.arange(int(starts[j]) + int(unaligned[j]), int(starts[j]) + int(aligned[j])))
        if cpu_sync:
            alloc = int(aligned.sum())
        else:   # buffer.hpp:1066-1070: the worst case
            alloc = align(R * tokens_max * min(num_topk, e) + (alignment - 1) * e, alignment)
        cat = (lambda ts: torch.cat(ts) if ts else torch.zeros(0, dtype=torch.long))
        return {"send": send, "recv": recv, "send_index": send_index, "num_tokens": T, "n_recv": n_recv,
                "order": (cat(rows_l), cat(ks_l)), "slot_rows": cat(slot_l), "padding": cat(padding),
                "slots": slots, "recv_src": recv_src, "unaligned": unaligned, "aligned": aligned, "starts": starts,
                "alloc": alloc, "per_expert_list": []}

    def _handle(self, route: dict[str, Any], topk_idx: torch.Tensor, num_experts: int, alignment: int,
                tokens_max: int, num_sms: int, cpu_sync: bool, copy: bool, num_topk: int) -> EPHandle:
        R, n = self.num_ranks, route["n_recv"]
        n_meta = n if cpu_sync else R * tokens_max     # buffer.hpp:1067: the worst case without the CPU sync
        meta = torch.full((n_meta, num_topk + 2), -1, dtype=torch.int32)
        meta[:n, 0] = route["recv_src"]
        meta[:n, 1] = route["recv_src"] // tokens_max
        meta[:n, 2:] = route["slots"].to(torch.int32)
        src_rank = route["recv_src"] // tokens_max
        per_up = torch.tensor([int((src_rank % self.num_scaleup_ranks == r).sum())
                               for r in range(self.num_scaleup_ranks)], dtype=torch.int32)
        psum_expert = (route["starts"] + route["unaligned"]).to(torch.int32)
        hybrid = self.num_scaleout_ranks > 1
        handle = EPHandle(True, num_experts, alignment, tokens_max, num_sms, topk_idx.clone() if copy else topk_idx,
                          n if cpu_sync else R * tokens_max,
                          int(route["aligned"].sum()) if cpu_sync else route["alloc"], list(route["per_expert_list"]),
                          torch.cumsum(per_up, 0).to(torch.int32), psum_expert, route["unaligned"].to(torch.int32),
                          meta, torch.zeros(topk_idx.shape, dtype=torch.int32),
                          torch.zeros(1, 1, 2 + 2 * num_topk, dtype=torch.int32) if hybrid else None,
                          torch.zeros(1, 1, self.num_scaleup_ranks, dtype=torch.int32) if hybrid else None)
        handle._route = route
        return handle

    # -- combine ---------------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        check_torch_deterministic()                                                          # elastic.py:1083
        num_sms = handle.num_sms if num_sms == 0 else num_sms
        num_qps = self.get_theoretical_num_qps(num_sms) if num_qps == 0 else num_qps
        assert num_qps <= self.num_allocated_qps, 'Allocated QPs are not enough'           # elastic.py:1088
        assert bias is None, "bias is not modelled"
        self._record("combine", num_sms=num_sms, with_weights=topk_weights is not None,
                     async_with_compute_stream=async_with_compute_stream, previous_event=previous_event)
        _host_assert(num_sms > 0, "buffer.hpp:1198", "num_sms > 0")
        _host_assert(x.dim() == 2 and x.is_contiguous(), "buffer.hpp:1202", "x.is_cuda() and x.is_contiguous()")
        _host_assert(x.dtype == torch.bfloat16, "buffer.hpp:1203", "x.scalar_type() == torch::kBFloat16")
        hidden = x.shape[1]
        _host_assert((hidden * x.element_size()) % 16 == 0, "buffer.hpp:1204",
                     "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        num_combined, K = handle.topk_idx.shape
        _host_assert(num_combined <= handle.num_max_tokens_per_rank, "buffer.hpp:1214",
                     "num_combined_tokens <= num_max_tokens_per_rank")
        if topk_weights is not None:
            shape_ok = topk_weights.shape == ((x.shape[0],) if handle.do_expand else (x.shape[0], K))
            _host_assert(shape_ok, "buffer.hpp:1226-1231", "num_tokens == num_tokens__")
            _host_assert(topk_weights.is_contiguous(), "buffer.hpp:1233", "topk_weights->is_contiguous()")
            _host_assert(topk_weights.dtype == torch.float32, "buffer.hpp:1234",
                         "topk_weights->scalar_type() == torch::kFloat")
        self._stream_control(previous_event, allocate_on_comm_stream)
        need = combine_bytes(handle.num_max_tokens_per_rank, hidden, K, self.num_scaleout_ranks,
                             self.num_scaleup_ranks, self.num_scaleup_ranks == self.num_nvlink_ranks,
                             self.allow_multiple_reduction)
        _host_assert(need <= self.num_bytes, "buffer.hpp:1254-1256", "get_combine_buffer_size(...) <= num_buffer_bytes")
        if K > 32:
            raise RuntimeError("Assertion exception (csrc/jit/compiler.hpp:239): false and \"NVCC compilation failed\" "
                               "(combine_reduce_epilogue.cuh:65: static_assert(kNumTopk <= 32))")
        route = handle._route
        with HOST_WORK():
            slots = route["slots"]
            valid = slots >= 0
            safe = slots.clamp(min=0)
            # the reduction within this rank (fp32, then bf16: allow_multiple_reduction), then at home over ranks
            rows = (x.float()[safe] * valid.unsqueeze(-1)).sum(1).to(torch.bfloat16)
            back = self._exchange(rows, route["recv"], route["send"]).float()
            y = torch.zeros(route["num_tokens"], hidden).index_add_(0, route["send_index"], back).to(torch.bfloat16)
            w = None
            if topk_weights is not None:
                per_k = torch.where(valid, topk_weights.float()[safe], 0.0)
                back_w = self._exchange(per_k, route["recv"], route["send"])
                w = torch.zeros(route["num_tokens"], K).index_add_(0, route["send_index"], back_w)
        (y, w), event = self._finish([y, w], async_with_compute_stream)
        return y, w, event


def module() -> types.ModuleType:
    """A fresh ``deep_ep`` 2.x stand-in: ``ElasticBuffer`` (this file) and the legacy ``Buffer``
    (tests/dispatch/deepep_standin.py), with empty call logs, as DeepEP 2.x's ``deep_ep/__init__.py`` exports them."""
    from tests.dispatch import deepep_standin

    legacy = deepep_standin.module()
    ElasticBuffer.instances, ElasticBuffer.calls = [], []
    deepep_elastic_comm.reset()
    mod = types.ModuleType("deep_ep")
    mod.Buffer, mod.Config = legacy.Buffer, legacy.Config
    mod.ElasticBuffer, mod.EPHandle, mod.EventOverlap, mod.EventHandle = ElasticBuffer, EPHandle, EventOverlap, \
        EventHandle
    mod.topk_idx_t = topk_idx_t
    mod.__version__ = "2.1.0"
    mod.STANDIN = "tests/dispatch/deepep_elastic_standin.py"
    return mod
