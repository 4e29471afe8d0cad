"""The flex dispatcher on DeepEP V2's ``ElasticBuffer`` (``--moe-flex-dispatcher-backend deepep``): sync-free.

API: ``deep_ep.ElasticBuffer`` of DeepEP 2.x (``deep_ep/buffers/elastic.py``; NCCL Gin transport, kernels built
at run time by its JIT), used as DeepEP's README pairs the calls for training:

- **torch's NCCL communicator, formed first**: DeepEP V2 reuses the group's (``_comm_ptr()``, null until the
  group's first collective), so ``ElasticBuffers`` runs one all-reduce on the group before DeepEP first sees it
  (``dispatch.deepep_nccl``, which also states DeepEP's import-time libnccl check in one line).
- **one buffer per process and etp x ep group**, shared by every MoE layer (``ElasticBuffers``), sized by
  ``ElasticBuffer.get_buffer_size_hint`` from the layout's worst case: the most tokens a rank routes per MoE call
  (``num_max_tokens_per_rank``: micro-batch x sequence / (tp x cp)), the hidden size, top-k x etp, and the larger
  of the FP8 and bf16 layouts (with FP8 dispatch the forward sends e4m3, but combine's backward dispatches bf16
  gradients through the same buffer). Created at the first dispatch (collective), with ``explicitly_destroy=True``,
  and destroyed by ``ElasticBuffers.destroy()`` when the run ends (``training.launch.ranks``).
- ``num_sms``: ``ElasticBuffer.get_theoretical_num_sms(E x etp, top-k x etp)`` (DeepEP's analytic SM count)
  unless ``--moe-deepep-num-sms`` is given; QPs: DeepEP's own (``num_qps=0``).
- **hybrid or direct** (``--moe-deepep-mode``): ``allow_hybrid_mode=True`` (DeepEP's default) sends a token over
  RDMA once per destination node and forwards it over NVLink there; direct mode sends it to every destination
  rank itself. Within one NVLink domain the two are the same.
- **sync-free dispatch**: ``do_cpu_sync=False``, ``do_expand=True``, ``do_zero_padding=True``. DeepEP writes the
  received selections straight into the experts' layout: one row per (token, top-k) selection of a local expert,
  expert-major, each expert's block starting at a multiple of ``expert_alignment`` with zeroed padding (no
  permutation or padding copy of moefold's), its top-k weight alongside (1-D). The counts stay on the device:
  ``handle.psum_num_recv_tokens_per_expert`` becomes ``Dispatched.tokens_per_expert_e`` (aligned block sizes),
  which ``grouped_mm`` takes as device offsets. Without the host read DeepEP allocates the received tensors for
  the worst case, ``ranks x num_max_tokens_per_rank x min(top-k x etp, local experts)`` rows plus alignment
  (``csrc/elastic/buffer.hpp``): the rows past the last expert's carry no token, the experts skip them
  (``moe.experts``) and combine never reads them. That costs memory in proportion to the worst case: the
  experts' activations are that many rows (``moefold plan`` counts them). ``--moe-deepep-cpu-sync`` (default:
  on exactly when the expert GEMMs take host counts anyway: ``te``, ``grouped_gemm``, ``loop``, FP8) lets
  DeepEP's host wait for the counts instead (one host synchronisation per dispatch, in its C++), with exact
  sizes and ``num_recv_tokens_per_expert_list`` as the host counts.
- ``expert_alignment``: the FP8 expert GEMMs' row multiple when they are on (``FP8Config.group_alignment``),
  else 1; ``cumulative_local_expert_recv_stats``: a fresh int32 ``[e]`` per dispatch, the copies each local
  expert received, returned as ``Dispatched.received_e`` for the load-balance metrics.
- **asynchrony**: dispatch runs with ``async_with_compute_stream=True`` on DeepEP's communication stream (which
  waits for the work already queued on ours); the dispatch exchange's ``start`` returns while the tokens travel
  and its ``wait()`` makes the compute stream wait on DeepEP's ``EventOverlap`` (no host wait): the MoE layer runs the
  shared experts in between. Combine and both backward passes are waited on the same way, at once in the plain
  layer, after the other micro-batch's computation under the batch-level overlap.
- **forward/backward pairs** as DeepEP's README defines them: dispatch's backward is ``combine`` of the
  gradients with the dispatch's handle (the top-k weights' gradients reduced alongside); combine's backward is a
  dispatch with the cached handle (``handle=``, no ``topk_idx``, no CPU sync). Each direction is an exchange
  object (``ElasticDispatchExchange`` / ``ElasticCombineExchange``, ``dispatch.token_exchange.TokenExchange``s:
  ``start`` and ``start_backward``), connected to autograd after its wait: the MoE layer chains the stages
  (``moe.layer``), the batch-level overlap schedules run them as separate nodes, the exchange in flight while
  another micro-batch computes.
- FP8 dispatch (``--moe-fp8-dispatch``): the rows leave as e4m3 with one fp32 scale per 128 channels
  (``dispatch.fp8_exchange.quantize_rows``, DeepEP's ``(data, scales)`` input) and are dequantised on arrival;
  gradients return in bf16 and the cast counts as the identity, as with the other dispatchers.

Capacity modes: dropped copies are sent as ``-1`` (never sent). ``pad_expert_input_to_capacity`` changes no row:
its purpose, shapes known without a host read, is what the sync-free layout gives anyway (the rows are DeepEP's,
aligned by ``expert_alignment``; padding an expert's block to its capacity would add rows nobody computes on).

Routing weights: DeepEP's combine adds the rows it brings home without weights (its test's reference,
``deep_ep/utils/refs.py`` ``combine``), so each row is weighted on the expert rank before the combine, with the
weight that arrived with it (one per row, in DeepEP's expanded layout: ``Dispatched.probs_N``), by the experts
inside their activation (``moe.activation``, as Megatron-Core's flex dispatcher hands its ``dispatched_probs`` to
the experts); its gradient returns in the backward combine. Expert tensor parallelism works as in
the legacy backend (``dispatch.deepep``): etp virtual experts per expert over the etp x ep group, the etp partial
sums added by the combine.

``deep_ep`` is imported lazily. DeepEP V2 needs Hopper-class GPUs (SM90 PTX), NCCL >= 2.30.4, NVLink within a
node (RDMA across), bf16 tokens with ``hidden x 2`` a multiple of 32 bytes (``hidden`` a multiple of 32 with FP8
dispatch: DeepEP's TMA alignment), at most 32 (virtual) experts per token, 2048 experts, 256 per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moefold.dispatch.base import Dispatched, DispatchHandle, DispatchPrep, PhaseTimer, TokenDispatcher
from moefold.dispatch.config import DispatcherKind, FlexOptions
from moefold.dispatch.deepep import check_flex_topk, flex_group, virtual_experts
from moefold.dispatch.deepep_nccl import NCCL_MIN_TEXT, import_deep_ep, start_communicator
from moefold.dispatch.fp8_exchange import dequantize_rows, quantize_rows
from moefold.dispatch.routing import Routing
from moefold.dispatch.token_exchange import Arrival, InFlight, TokenExchange, after_event
from moefold.parallel.groups import Group

DEEPEP_V2_VERSION = "2.1.0"
V2_INSTALL_HINT = ("the flex dispatcher's deepep backend needs DeepEP V2 (deep_ep >= 2.0 with ElasticBuffer; not on "
                   f"PyPI): pip install 'nvidia-nccl-cu13>={NCCL_MIN_TEXT}' --no-deps (cu12 for CUDA 12) into torch's "
                   "environment, then "
                   "`python setup.py install` in a https://github.com/deepseek-ai/DeepEP checkout (kernels are built "
                   "at run time, no CUDA build at install); docs/gpus.md")
MAX_EXPERTS, MAX_LOCAL_EXPERTS = 2048, 256      # WorkspaceLayout::kNumMaxExperts / kNumMaxExpertsPerRank


def import_elastic() -> Any:
    """``deep_ep`` with ``ElasticBuffer`` (DeepEP 2.x), or ImportError of one line saying what to install or why it
    does not load (its NCCL check: ``dispatch.deepep_nccl``)."""
    deep_ep = import_deep_ep(V2_INSTALL_HINT)
    if not hasattr(deep_ep, "ElasticBuffer"):
        version = getattr(deep_ep, "__version__", "1.x")
        raise ImportError(f"the installed DeepEP ({version}) has no ElasticBuffer (V2): use "
                          f"--moe-flex-dispatcher-backend deepep-legacy, or install V2: {V2_INSTALL_HINT}")
    return deep_ep


def check_elastic_layout(hidden_size: int, num_experts: int, ep: int, etp: int, fp8: bool) -> None:
    """ValueError naming the numbers (and flags) when DeepEP V2 cannot run this layout: its TMA rows (hidden bytes a
    multiple of 32: hidden a multiple of 16 in bf16, of 32 with FP8 dispatch) and its experts (at most 2048
    virtual experts, E x etp, and 256 per rank: ``WorkspaceLayout``)."""
    row = 32 if fp8 else 16
    if hidden_size % row:
        raise ValueError(f"the flex dispatcher on DeepEP V2 needs a hidden size that is a multiple of {row} "
                         f"({'e4m3 rows with --moe-fp8-dispatch' if fp8 else 'bf16 rows'} of a multiple of 32 bytes), "
                         f"got --hidden-size {hidden_size}")
    virtual, local = num_experts * etp, num_experts // max(ep, 1)
    if virtual > MAX_EXPERTS or local > MAX_LOCAL_EXPERTS:
        raise ValueError(f"DeepEP V2 takes at most {MAX_EXPERTS} experts ({MAX_LOCAL_EXPERTS} per rank); got "
                         f"--num-experts {num_experts} x --expert-tensor-parallel-size {etp} = {virtual} with {local} "
                         f"per rank (--expert-model-parallel-size {ep})")


@dataclass(frozen=True)
class ElasticLayout:
    """What sizes the buffer (the layout's worst case) and shapes every call of one dispatcher.

    num_max_tokens_per_rank: the most tokens any rank dispatches in one call (the same on every rank);
    num_experts / num_topk: the virtual experts (E x etp) and selections per token (top-k x etp);
    hybrid: ``allow_hybrid_mode``; fp8: FP8 forward dispatch.
    """

    num_max_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_topk: int
    hybrid: bool = True
    fp8: bool = False

    def buffer_bytes(self, buffer_cls: Any, group: Any) -> int:
        """DeepEP's hint for this layout: the larger of the FP8 (forward) and bf16 (gradient) dispatch layouts."""
        return max(buffer_cls.get_buffer_size_hint(group, self.num_max_tokens_per_rank, self.hidden,
                                                   num_topk=self.num_topk, use_fp8_dispatch=fp8,
                                                   allow_hybrid_mode=self.hybrid)
                   for fp8 in {self.fp8, False})


class ElasticBuffers:
    """DeepEP V2 buffers of this process: one per group, shared by all MoE layers (``ELASTIC_BUFFERS`` below).

    ``created`` counts the buffers made. A later layer needing more bytes (or more tokens per rank) gets a larger
    one; the old one is kept until the run ends (a pending backward may still use it). ``destroy()`` releases
    them (collective over each buffer's group); ``forget()`` drops them without (a run that failed), so that
    their destructors only warn (``~ElasticBuffer`` in csrc/elastic/buffer.hpp) instead of synchronising.
    """

    def __init__(self) -> None:
        self._buffers: dict[Any, tuple[Any, ElasticLayout]] = {}
        self._retired: list[Any] = []
        self.created = 0

    def get(self, deep_ep: Any, group: Any, layout: ElasticLayout, device: torch.device) -> Any:
        """The buffer for ``group`` large enough for ``layout`` (collective on creation). ``device``: where this
        rank's tokens are; before DeepEP first sees the group, torch's communicator of it is formed there
        (``dispatch.deepep_nccl.start_communicator``: DeepEP reuses and caches it, deep_ep/utils/comm.py:57-64)."""
        found = self._buffers.get(group)
        if found is None:
            start_communicator(group, device)
        need = layout.buffer_bytes(deep_ep.ElasticBuffer, group)
        if found is not None:
            buffer, made_for = found
            if made_for.hybrid != layout.hybrid:
                raise ValueError(f"one DeepEP buffer per group runs one mode: it was made with allow_hybrid_mode="
                                 f"{made_for.hybrid}, a layer asks for {layout.hybrid}; use one --moe-deepep-mode")
            if buffer.num_bytes >= need and buffer.num_max_tokens_per_rank >= layout.num_max_tokens_per_rank:
                return buffer
            self._retired.append(buffer)
        buffer = deep_ep.ElasticBuffer(group, num_bytes=need, num_max_tokens_per_rank=layout.num_max_tokens_per_rank,
                                       hidden=layout.hidden, num_topk=layout.num_topk, use_fp8_dispatch=layout.fp8,
                                       allow_hybrid_mode=layout.hybrid, explicitly_destroy=True)
        self._buffers[group] = (buffer, layout)
        self.created += 1
        return buffer

    def destroy(self) -> int:
        """``ElasticBuffer.destroy()`` on every buffer (a barrier over its group: every rank must call it)."""
        buffers = [*self._retired, *(b for b, _ in self._buffers.values())]
        self._buffers, self._retired = {}, []
        for buffer in buffers:
            buffer.destroy()
        return len(buffers)

    def forget(self) -> int:
        count = len(self._buffers) + len(self._retired)
        self._buffers, self._retired = {}, []
        return count


ELASTIC_BUFFERS = ElasticBuffers()


@dataclass(frozen=True)
class ElasticCall:
    """The arguments every ``dispatch`` / ``combine`` of one dispatcher repeats."""

    num_experts: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    num_sms: int
    cpu_sync: bool


@dataclass(frozen=True)
class ElasticArrival:
    """What a dispatch delivered besides the rows: DeepEP's handle and the per-expert received counts."""

    handle: Any
    received_e: Tensor


@dataclass(frozen=True)
class ElasticDispatchExchange(TokenExchange[ElasticArrival]):
    """Forward: ``ElasticBuffer.dispatch`` of the tokens (FP8 when ``fp8``) and top-k weights (when sent), in
    flight until its event. Backward: ``combine`` of both gradients with the dispatch's handle."""

    buffer: Any
    topk_idx: Tensor
    call: ElasticCall
    fp8: bool = False

    def start(self, *tensors: Tensor) -> InFlight[Arrival[ElasticArrival]]:
        """``(x [T, H] bf16, weights [T, K] fp32)`` or ``(x,)`` (no probs: unweighted experts) -> at ``wait()``:
        ``Arrival((rows [N, H] in x's dtype[, weights [N]]), ElasticArrival)``."""
        x, *weights = tensors
        c = self.call
        e = c.num_experts // self.buffer.num_ranks
        stats = torch.zeros(e, dtype=torch.int32, device=x.device)
        sent: Any = quantize_rows(x) if self.fp8 else x.contiguous()
        recv, _, recv_w, handle, event = self.buffer.dispatch(
            sent, topk_idx=self.topk_idx, topk_weights=weights[0].contiguous() if weights else None,
            cumulative_local_expert_recv_stats=stats, num_experts=c.num_experts,
            num_max_tokens_per_rank=c.num_max_tokens_per_rank, expert_alignment=c.expert_alignment,
            num_sms=c.num_sms, async_with_compute_stream=True, do_cpu_sync=c.cpu_sync, do_expand=True,
            do_zero_padding=True)
        dtype = x.dtype

        def finish() -> Arrival[ElasticArrival]:
            event.current_stream_wait()   # the compute stream waits on DeepEP's: no host wait
            rows = dequantize_rows(*recv, dtype) if self.fp8 else recv
            return Arrival((rows,) if recv_w is None else (rows, recv_w), ElasticArrival(handle, stats))

        return InFlight(finish)

    def start_backward(self, grads: Sequence[Tensor], meta: ElasticArrival) -> InFlight[tuple[Tensor, ...]]:
        grad_rows, *grad_w = grads
        out, out_w, event = self.buffer.combine(
            grad_rows.to(torch.bfloat16).contiguous(), meta.handle,
            topk_weights=grad_w[0].float().contiguous() if grad_w else None, num_sms=self.call.num_sms,
            async_with_compute_stream=True)

        return after_event(event, (out,) if not grad_w else (out, out_w))


@dataclass(frozen=True)
class ElasticCombineExchange(TokenExchange[None]):
    """Forward: ``ElasticBuffer.combine`` (per token, the sum of its rows on every rank). Backward: a dispatch of
    the gradient with the cached handle (no CPU sync, zeroed padding)."""

    buffer: Any
    handle: Any
    call: ElasticCall

    def start(self, *tensors: Tensor) -> InFlight[Arrival[None]]:
        (rows,) = tensors
        y, _, event = self.buffer.combine(rows.contiguous(), self.handle, num_sms=self.call.num_sms,
                                          async_with_compute_stream=True)

        return after_event(event, Arrival((y,), None))

    def start_backward(self, grads: Sequence[Tensor], meta: None) -> InFlight[tuple[Tensor, ...]]:
        (grad,) = grads
        out, _, _, _, event = self.buffer.dispatch(grad.to(torch.bfloat16).contiguous(), handle=self.handle,
                                                   num_sms=self.call.num_sms, async_with_compute_stream=True,
                                                   do_expand=True, do_zero_padding=True)

        return after_event(event, (out,))


@dataclass(frozen=True)
class ElasticPrep(DispatchPrep):
    """``prepare_dispatch``'s frozen result: the dispatch exchange (it holds the call's settings). Whether the
    experts weight the rows is what arrives: the weights travel only when they do."""

    exchange: ElasticDispatchExchange


@dataclass(frozen=True)
class ElasticHandle(DispatchHandle):
    """exchange: the combine's exchange (DeepEP's buffer and handle)."""

    exchange: ElasticCombineExchange


def aligned_counts(psum_e: Tensor, alignment: int) -> Tensor:
    """DeepEP's expanded ``psum_num_recv_tokens_per_expert`` (expert i's aligned start + its real count) -> int64
    ``[e]`` rows per expert block, padding included (device ops only)."""
    ends = psum_e.long()
    if alignment > 1:
        ends = (ends + alignment - 1).div(alignment, rounding_mode="floor") * alignment
    return torch.diff(ends, prepend=ends.new_zeros(1))


class ElasticFlexDispatcher(TokenDispatcher):
    """DeepEP V2 flex dispatcher over the etp x ep group (module docstring).

    ``options``: ``FlexOptions`` (checked there): ``max_tokens_per_rank`` sizes the buffer (with ``hidden_size``);
    ``num_sms`` 0 = DeepEP's theoretical count; ``cpu_sync``: let DeepEP read the counts on the host (exact sizes,
    one host wait per dispatch), None: exactly when ``experts_read_host_counts``; ``hybrid``: ``allow_hybrid_mode``.
    ``expert_alignment``: row multiple of each expert's block; ``fp8``: FP8 dispatch; ``buffers``: where the buffer
    comes from (default ``ELASTIC_BUFFERS``).
    """

    kind = DispatcherKind.FLEX
    name = "flex"

    def __init__(self, num_experts: int, ep_group: Group = None, etp_group: Group = None,
                 etp_ep_group: Group = None, timer: PhaseTimer | None = None, *, options: FlexOptions,
                 hidden_size: int, expert_alignment: int = 1, experts_read_host_counts: bool = False,
                 fp8: bool = False, buffers: ElasticBuffers | None = None):
        deep_ep = import_elastic()
        super().__init__(num_experts, ep_group, etp_group, timer)
        self.group = flex_group(self, etp_ep_group)
        max_tokens_per_rank = options.max_tokens_per_rank
        if max_tokens_per_rank is None:
            raise ValueError(f"the flex dispatcher (DeepEP V2) sizes its buffer by the most tokens a rank routes per "
                             f"MoE call (num_max_tokens_per_rank: micro-batch x sequence / (tp x cp), which the "
                             f"trainer sets); got max_tokens_per_rank={max_tokens_per_rank!r}")
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"the flex dispatcher (DeepEP V2): hidden_size={hidden_size!r} must be a positive integer")
        check_elastic_layout(hidden_size, num_experts, self.ep, self.etp, fp8)
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment={expert_alignment!r} must be a positive integer")
        virtual = num_experts * self.etp
        self._deep_ep, self.hidden_size, self.max_tokens_per_rank = deep_ep, hidden_size, max_tokens_per_rank
        self.num_sms, self.hybrid, self.fp8 = options.num_sms, options.hybrid, fp8
        self.cpu_sync = options.cpu_sync_for(experts_read_host_counts)
        self.expert_alignment, self.num_virtual_experts = expert_alignment, virtual
        self.buffers = ELASTIC_BUFFERS if buffers is None else buffers

    def layout(self, topk: int) -> ElasticLayout:
        return ElasticLayout(self.max_tokens_per_rank, self.hidden_size, self.num_virtual_experts, topk * self.etp,
                             self.hybrid, self.fp8)

    # -- dispatch: prepare (checks, virtual experts, the buffer) -> exchange (DeepEP's dispatch) -> finish ------
    def prepare_dispatch(self, x_TH: Tensor, routing: Routing, *, with_probs: bool = True,
                         ) -> tuple[tuple[Tensor, ...], ElasticPrep]:
        self._check(x_TH, routing)
        if x_TH.dtype != torch.bfloat16:
            raise ValueError(f"the flex dispatcher moves bf16 tokens (DeepEP), got x of dtype {x_TH.dtype}")
        num_tokens, hidden = x_TH.shape
        if hidden != self.hidden_size:
            raise ValueError(f"flex dispatch: x has hidden size {hidden}, the dispatcher was built for "
                             f"{self.hidden_size}")
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(f"flex dispatch: {num_tokens} tokens on this rank, more than the "
                             f"{self.max_tokens_per_rank} (num_max_tokens_per_rank) DeepEP's buffer was sized for")
        K = routing.expert_ids_TK.shape[1]
        check_flex_topk(K, self.etp)
        topk_idx = routing.expert_ids_TK.long()
        if routing.keep_TK is not None:   # DeepEP skips -1 entries: dropped copies are never sent
            topk_idx = topk_idx.masked_fill(~routing.keep_TK.bool(), -1)
        probs_TK = routing.probs_TK.float()
        if self.etp > 1:
            topk_idx, probs_TK = virtual_experts(topk_idx, probs_TK, self.num_local_experts, self.etp)
        buffer = self.buffers.get(self._deep_ep, self.group, self.layout(K), x_TH.device)
        num_sms = self.num_sms or buffer.get_theoretical_num_sms(self.num_virtual_experts, K * self.etp)
        call = ElasticCall(self.num_virtual_experts, self.max_tokens_per_rank, self.expert_alignment, num_sms,
                           self.cpu_sync)
        exchange = ElasticDispatchExchange(buffer, topk_idx.contiguous(), call, self.fp8)
        sent = (x_TH, probs_TK) if with_probs else (x_TH,)
        return sent, ElasticPrep(num_tokens=num_tokens, exchange=exchange)

    def dispatch_exchange(self, prep: ElasticPrep) -> ElasticDispatchExchange:
        return prep.exchange

    def finish_dispatch(self, received: tuple[Tensor, ...], meta: ElasticArrival, prep: ElasticPrep,
                        ) -> Dispatched[ElasticHandle]:
        rows, *weights = received
        call, ep_handle = prep.exchange.call, meta.handle
        counts = aligned_counts(ep_handle.psum_num_recv_tokens_per_expert, call.expert_alignment)
        host = tuple(int(c) for c in ep_handle.num_recv_tokens_per_expert_list) if call.cpu_sync else None
        handle = ElasticHandle(num_tokens=prep.num_tokens, num_rows=rows.shape[0],
                               exchange=ElasticCombineExchange(prep.exchange.buffer, ep_handle, call))
        # the [N] weight of each row as DeepEP delivered it (the experts apply it), or None
        return Dispatched(rows, counts, handle, host, received_e=meta.received_e,
                          probs_N=weights[0] if weights else None)

    # -- combine: prepare (the rows as DeepEP takes them) -> exchange (DeepEP's combine) -> finish (nothing left) -
    def prepare_combine(self, expert_out_NH: Tensor, handle: ElasticHandle) -> tuple[Tensor, ...]:
        self._check_combine(expert_out_NH, handle, ElasticHandle)
        with self._phase("unpermute"):
            # weighted by the experts already; DeepEP's combine adds them up without weights, in bf16 rows
            return (expert_out_NH.to(torch.bfloat16),)

    def combine_exchange(self, handle: ElasticHandle) -> ElasticCombineExchange:
        return handle.exchange

    def finish_combine(self, received: tuple[Tensor, ...], handle: ElasticHandle) -> Tensor:
        return received[0]
