"""The flex dispatcher: DeepEP's fused NVLink/RDMA all-to-all kernels over the etp x ep group.

API: ``deep_ep.Buffer`` as in DeepEP v1.2.1 (its "normal" high-throughput kernels; DeepEP 2.x keeps
the same class as its legacy ``deep_ep.Buffer``), used the way DeepEP's README and Megatron-Core's
``fused_a2a`` use it:

- **one buffer per process and communication group**, shared by every MoE layer
  (``DeepEPBuffers``: a small cache keyed by group, not a buffer per layer), sized from DeepEP's
  own hints: ``Buffer.get_dispatch_config(n)`` / ``get_combine_config(n)`` and each config's
  ``get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint`` for the model's hidden size
  (bytes per bf16 token) and the group's n ranks. DeepEP puts up to 8 ranks in one NVLink domain;
  for a larger group (one spanning nodes) the RDMA hint is non-zero and allocated. Created at
  the first dispatch (a collective over the group), re-created only if a later call needs more.
  Created with ``explicitly_destroy=True`` and destroyed by ``DeepEPBuffers.destroy()`` when the run ends
  (``training.launch.ranks`` does it before the process group goes): DeepEP's docstring warns that releasing the
  buffer in its destructor, i.e. at interpreter exit, "may cause Python's exception handling process to
  hang" (``deep_ep/buffer.py``), since its ``destroy`` synchronises the device and barriers the group.
- ``Buffer.set_num_sms(--moe-deepep-num-sms)``: the SMs DeepEP's kernels take (even; default
  20, Megatron's default).
- **asynchronous exchanges** (``FlexDispatchExchange``, ``FlexCombineExchange``: the dispatcher's
  stages, ``dispatch.token_exchange``): ``get_dispatch_layout``, ``dispatch`` and ``combine`` run
  with ``previous_event`` (an event captured on the compute stream, so DeepEP's communication stream
  starts after the tokens are ready), ``async_finish=True`` and ``allocate_on_comm_stream=True``;
  ``start`` returns while the tokens travel and ``wait()`` makes the compute stream wait on DeepEP's
  event. The plain MoE layer runs the shared experts in flight of the dispatch; the overlap
  schedules (``pipeline.overlap``) another micro-batch's computation in flight of every exchange,
  forward and backward.
- host synchronisation: DeepEP's non-cached dispatch makes the CPU wait for the received
  counts (``num_recv_tokens_per_expert_list`` is a host list; DeepEP documents this); moefold
  adds none (the local permutation uses those host counts).

DeepEP moves each *token* once per destination rank (not once per copy) and returns, per
received token, its top-k expert ids translated to local ids (-1 where the expert lives
elsewhere) and the matching weights (0 there). We then permute locally into expert-major rows,
like the other dispatchers, so the experts see the same ``Dispatched`` contract. Autograd:
dispatch's backward is DeepEP's combine of the gradients (the top-k weight gradients reduced
alongside) and combine's backward is a cached-layout dispatch, as in DeepEP's README.

Where the routing weights are applied: **on the expert rank, inside the experts** (as everywhere:
``dispatch.base``). DeepEP's normal (intranode / internode) ``Buffer.combine`` adds the rows it brings
home *without weights* (its docstring: "addition **without** weights"; ``intranode.cu``'s combine kernel
sums the ``num_topk_ranks`` received rows per token): it returns one row per (token, source rank),
already the sum of that rank's copies, so each copy is weighted before that sum, on the expert rank. The
weights get there inside DeepEP's dispatch message (``topk_weights``, 4 bytes per top-k entry, written by
the same kernel as the token: no separate exchange, as Megatron-Core's flex dispatcher receives its
``dispatched_probs``); the local permutation lays them out as the rows (``Dispatched.probs_N``), the
experts apply them inside their activation, and the combine's unpermute only sums each received token's
copies. Their gradient returns in the backward combine that carries the token gradients. Only DeepEP's
low-latency mode (``low_latency_combine(x, topk_idx, topk_weights, handle)``, "reduce **with weights**")
weights on the home rank; it needs IBGDA and a per-expert ``[e, max_tokens * ranks, H]`` layout, and
moefold does not use it.

Expert tensor parallelism (etp > 1) works as with the alltoall dispatcher, the way Megatron's
flex dispatcher does it over its tp x ep group: the group is etp x ep (``etp_ep_group``, rank
``ep_rank * etp + etp_rank``) and expert g becomes etp *virtual experts*, one on each etp rank of
the ep rank holding g; a token's k experts become k * etp virtual ones, so every etp rank receives
the rows of its experts, and DeepEP's combine adds the etp partial sums while it brings them home.

``deep_ep`` is imported lazily: choosing ``flex`` without it fails at construction. It needs
NVIDIA GPUs with NVLink (and NVSHMEM for groups spanning nodes), bf16 tokens with a hidden size
that is a multiple of 8, and an etp x ep group of 2, 4 or 8 ranks, or a multiple of 8 DeepEP
has a config for (the kernels are built for those); other sizes are refused at construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moefold.dispatch import deepep_nccl
from moefold.dispatch.base import Dispatched, DispatchHandle, DispatchPrep, PhaseTimer, TokenDispatcher
from moefold.dispatch.config import DispatcherKind, FlexOptions
from moefold.dispatch.permutation import RowMap, build_row_map, mask_groups, permute, permute_probs, unpermute
from moefold.dispatch.routing import Routing
from moefold.dispatch.token_exchange import Arrival, InFlight, TokenExchange, after_event
from moefold.parallel.groups import Group

DEEPEP_VERSION = "v1.2.1"
INSTALL_HINT = (f"the flex dispatcher needs DeepEP {DEEPEP_VERSION} (not on PyPI): build it from "
                f"https://github.com/deepseek-ai/DeepEP at tag {DEEPEP_VERSION} with `python setup.py install` "
                f"(NVSHMEM_DIR=... for groups spanning nodes); it needs CUDA GPUs with NVLink")
DEFAULT_NUM_SMS = 20
# DeepEP v1.2.1's dispatch and combine kernels assert num_topk <= 32 on the device (csrc/kernels/intranode.cu:187,
# internode.cu:408 and 1393): a trap that kills the rank while its peers wait in the collective
DEEPEP_MAX_TOPK = 32


def check_flex_topk(topk: int, etp: int) -> None:
    """ValueError naming both numbers when the flex dispatcher's top-k (the router's ``topk`` x ``etp``: each expert
    is etp virtual experts, as in Megatron's flex dispatcher) exceeds what DeepEP's kernels take."""
    if topk * etp > DEEPEP_MAX_TOPK:
        raise ValueError(f"the flex dispatcher sends each token to --moe-router-topk x --expert-tensor-parallel-size = "
                         f"{topk} x {etp} = {topk * etp} (virtual) experts, but DeepEP's kernels take at most "
                         f"{DEEPEP_MAX_TOPK} (a device-side assert kills the rank); lower one of them or use the "
                         f"alltoall dispatcher")


def virtual_experts(ids_TK: Tensor, probs_TK: Tensor, e: int, etp: int) -> tuple[Tensor, Tensor]:
    """etp > 1: expert g on ep rank r -> virtual experts (r*etp + t)*e + g%e for t < etp: [T, K*etp] ids (-1 stays
    -1) and probs, so every etp rank of the ep rank holding g receives g's rows (Megatron's flex dispatcher)."""
    T, K = ids_TK.shape
    t = torch.arange(etp, device=ids_TK.device)
    v = (ids_TK.div(e, rounding_mode="floor").unsqueeze(-1) * etp + t) * e + (ids_TK % e).unsqueeze(-1)
    v = torch.where(ids_TK.unsqueeze(-1) < 0, -1, v)
    return v.reshape(T, K * etp), probs_TK.unsqueeze(-1).expand(T, K, etp).reshape(T, K * etp)


def flex_group(dispatcher: TokenDispatcher, etp_ep_group: Group) -> Group:
    """The flex dispatcher's etp x ep group (``TokenDispatcher._etp_ep_group``), refusing one rank: DeepEP has no
    single-rank kernels."""
    if dispatcher.ep * dispatcher.etp == 1:
        raise ValueError("the flex dispatcher needs an etp x ep group of >= 2 ranks (DeepEP has no single-rank "
                         "kernels), got ep=1 etp=1; use 'local'")
    return dispatcher._etp_ep_group(etp_ep_group)


def import_deep_ep() -> Any:
    """Import ``deep_ep`` or raise ImportError of one line: what to install, or why it does not load
    (``dispatch.deepep_nccl.import_deep_ep``)."""
    return deepep_nccl.import_deep_ep(INSTALL_HINT)


def buffer_sizes(buffer_cls: Any, num_ranks: int, hidden_bytes: int) -> tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) for ``num_ranks`` ranks moving ``hidden_bytes`` per token.

    The larger of DeepEP's hints for its recommended dispatch and combine configs (its README's
    ``get_buffer``); the RDMA hint is 0 while the group fits one NVLink domain (<= 8 ranks).
    """
    nvl = rdma = 0
    for config in (buffer_cls.get_dispatch_config(num_ranks), buffer_cls.get_combine_config(num_ranks)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
    return nvl, rdma


class DeepEPBuffers:
    """DeepEP communication buffers of this process: one per group, shared by all MoE layers.

    ``BUFFERS`` below is the process-wide instance every flex dispatcher uses unless given its
    own (tests do). ``created`` counts the buffers made, for tests and logs. Buffers are created with
    ``explicitly_destroy=True``: ``destroy()`` releases them (collective over each buffer's group);
    ``forget()`` drops them without DeepEP's collective (a run ending in an error: a peer may never
    reach it), so that their destructors only warn instead of synchronising at interpreter exit.
    """

    def __init__(self) -> None:
        self._buffers: dict[Any, Any] = {}
        self._retired: list[Any] = []   # buffers a larger one replaced
        self._num_sms: int | None = None
        self.created = 0

    def get(self, deep_ep: Any, group: Any, hidden_bytes: int, num_sms: int) -> Any:
        """The buffer for ``group``, large enough for ``hidden_bytes`` per token (collective on creation)."""
        if self._num_sms not in (None, num_sms):
            raise ValueError(f"DeepEP's SM count is one per process (Buffer.set_num_sms): already {self._num_sms}, "
                             f"asked for {num_sms}; use one --moe-deepep-num-sms for every layer")
        if self._num_sms is None:
            deep_ep.Buffer.set_num_sms(num_sms)
            self._num_sms = num_sms
        nvl, rdma = buffer_sizes(deep_ep.Buffer, group.size(), hidden_bytes)
        buffer = self._buffers.get(group)
        if buffer is None or buffer.num_nvl_bytes < nvl or buffer.num_rdma_bytes < rdma:
            if buffer is not None:   # replaced: kept until the run ends (a pending backward may still use it)
                self._retired.append(buffer)
            buffer = deep_ep.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, explicitly_destroy=True)
            self._buffers[group] = buffer
            self.created += 1
        return buffer

    def destroy(self) -> int:
        """Release every buffer (``Buffer.destroy()``: synchronises the device and barriers its group, so every
        rank of each group must call it, as when a run ends normally). Returns how many were destroyed."""
        buffers = [*self._retired, *self._buffers.values()]
        self._buffers, self._retired = {}, []
        for buffer in buffers:
            buffer.destroy()
        return len(buffers)

    def forget(self) -> int:
        """Drop every buffer without DeepEP's collective destroy (a run that failed: its peers may be gone or
        stuck). With ``explicitly_destroy=True`` the C++ destructor then only prints DeepEP's "destroy() was not
        called" warning (``csrc/deep_ep.cpp`` ``~Buffer``); the process exit frees the memory."""
        count = len(self._buffers) + len(self._retired)
        self._buffers, self._retired = {}, []
        return count


BUFFERS = DeepEPBuffers()


@dataclass(frozen=True)
class FlexLayout:
    """What DeepEP's dispatch reports about the tokens it delivered: their [R, K] local expert ids (-1 where the
    expert lives elsewhere), the received copies per local expert (host ints) and its layout handle."""

    recv_idx: Tensor
    per_expert: tuple[int, ...]
    deep_ep_handle: Any


@dataclass(frozen=True)
class FlexDispatchExchange(TokenExchange[FlexLayout]):
    """Forward: layout + ``buffer.dispatch`` of tokens and top-k weights on DeepEP's stream (``previous_event``:
    after the work queued on ours; ``async_finish``), waited on through its event. Backward: ``buffer.combine``
    of both gradients (the weights' reduced alongside the tokens')."""

    buffer: Any
    topk_idx: Tensor
    num_experts: int

    def start(self, *tensors: Tensor) -> InFlight[Arrival[FlexLayout]]:
        x, weights_TK = tensors
        buffer = self.buffer
        previous = buffer.capture()  # DeepEP's stream starts after the work queued on ours
        per_rank, per_rdma_rank, per_expert, in_rank, layout_event = buffer.get_dispatch_layout(
            self.topk_idx, self.num_experts, previous_event=previous, async_finish=True, allocate_on_comm_stream=True)
        recv_x, recv_idx, recv_w, recv_per_expert, handle, event = buffer.dispatch(
            x.contiguous(), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=self.topk_idx,
            topk_weights=weights_TK.contiguous(), previous_event=layout_event, async_finish=True,
            allocate_on_comm_stream=True)

        return after_event(event, Arrival((recv_x, recv_w), FlexLayout(recv_idx, tuple(recv_per_expert), handle)))

    def start_backward(self, grads: Sequence[Tensor], meta: FlexLayout) -> InFlight[tuple[Tensor, ...]]:
        grad_x, grad_w = grads
        grad_in, grad_w_in, event = self.buffer.combine(
            grad_x.to(torch.bfloat16).contiguous(), meta.deep_ep_handle, topk_weights=grad_w.float().contiguous(),
            previous_event=self.buffer.capture(), async_finish=True, allocate_on_comm_stream=True)

        return after_event(event, (grad_in, grad_w_in))


@dataclass(frozen=True)
class FlexCombineExchange(TokenExchange[None]):
    """Forward: ``buffer.combine`` (per token, the sum of every rank's rows). Backward: the cached ``dispatch``."""

    buffer: Any
    deep_ep_handle: Any

    def start(self, *tensors: Tensor) -> InFlight[Arrival[None]]:
        (y_recv,) = tensors
        y, _, event = self.buffer.combine(y_recv.contiguous(), self.deep_ep_handle,
                                          previous_event=self.buffer.capture(), async_finish=True,
                                          allocate_on_comm_stream=True)

        return after_event(event, Arrival((y,), None))

    def start_backward(self, grads: Sequence[Tensor], meta: None) -> InFlight[tuple[Tensor, ...]]:
        (grad,) = grads
        grad_recv, _, _, _, _, event = self.buffer.dispatch(
            grad.to(torch.bfloat16).contiguous(), handle=self.deep_ep_handle, previous_event=self.buffer.capture(),
            async_finish=True, allocate_on_comm_stream=True)

        return after_event(event, (grad_recv,))


@dataclass(frozen=True)
class FlexPrep(DispatchPrep):
    """``prepare_dispatch``'s findings: the exchange, the routing's capacity mode and whether the experts get the
    probs."""

    exchange: FlexDispatchExchange
    pad_to_capacity: bool
    capacity: int | None
    with_probs: bool


@dataclass(frozen=True)
class FlexHandle(DispatchHandle):
    """row_map: the local permutation of received tokens; deep_ep_handle: DeepEP's layout for combine; buffer:
    the DeepEP buffer the dispatch used (combine must use it)."""

    row_map: RowMap
    deep_ep_handle: Any
    buffer: Any


class FlexDispatcher(TokenDispatcher):
    """DeepEP-backed dispatcher over the etp x ep group (NVLink intra-node, RDMA inter-node).

    ``etp_ep_group``: the etp x ep ranks, rank ``ep_rank * etp + etp_rank`` (``ParallelDims.etp_ep_group``);
    may be None when etp or ep is 1 (then it is the other group). ``options``: ``FlexOptions`` (checked there; this
    backend reads ``num_sms``, 0 meaning ``DEFAULT_NUM_SMS``). ``buffers``: where the DeepEP buffer comes from
    (default: the process-wide ``BUFFERS``).
    """

    kind = DispatcherKind.FLEX
    name = "flex"

    def __init__(self, num_experts: int, ep_group: Group = None, etp_group: Group = None,
                 etp_ep_group: Group = None, timer: PhaseTimer | None = None, *,
                 options: FlexOptions | None = None, buffers: DeepEPBuffers | None = None):
        deep_ep = import_deep_ep()
        super().__init__(num_experts, ep_group, etp_group, timer)
        n = self.ep * self.etp
        etp_ep_group = flex_group(self, etp_ep_group)
        num_sms = (options or FlexOptions()).num_sms or DEFAULT_NUM_SMS
        try:
            deep_ep.Buffer.get_dispatch_config(n)
        except AssertionError as exc:
            raise ValueError(f"DeepEP {DEEPEP_VERSION} has no kernel config for an etp*ep={self.etp}*{self.ep}={n} "
                             f"rank group (2, 4 or 8 ranks in a node, or a multiple of 8 across nodes); "
                             f"use the alltoall dispatcher") from exc
        self._deep_ep, self.group, self.num_sms = deep_ep, etp_ep_group, num_sms
        self.buffers = BUFFERS if buffers is None else buffers
        self.num_virtual_experts = num_experts * self.etp

    def _virtual(self, ids_TK: Tensor, probs_TK: Tensor) -> tuple[Tensor, Tensor]:
        return virtual_experts(ids_TK, probs_TK, self.num_local_experts, self.etp)

    def prepare_dispatch(self, x_TH: Tensor, routing: Routing, *, with_probs: bool = True,
                         ) -> tuple[tuple[Tensor, ...], FlexPrep]:
        self._check(x_TH, routing)
        if x_TH.dtype != torch.bfloat16:
            raise ValueError(f"the flex dispatcher moves bf16 tokens (DeepEP), got x of dtype {x_TH.dtype}")
        H = x_TH.shape[1]
        if H % 8:
            raise ValueError(f"the flex dispatcher needs a hidden size that is a multiple of 8 (DeepEP copies "
                             f"16-byte words), got {H}")
        check_flex_topk(routing.expert_ids_TK.shape[1], self.etp)   # the layout check refuses it before any rank
        topk_idx = routing.expert_ids_TK.long()
        if routing.keep_TK is not None:  # DeepEP skips -1 entries: dropped copies are never sent
            topk_idx = topk_idx.masked_fill(~routing.keep_TK.bool(), -1)
        probs_TK = routing.probs_TK.float()
        if self.etp > 1:
            topk_idx, probs_TK = self._virtual(topk_idx, probs_TK)
        buffer = self.buffers.get(self._deep_ep, self.group, H * x_TH.element_size(), self.num_sms)
        exchange = FlexDispatchExchange(buffer, topk_idx.contiguous(), self.num_virtual_experts)
        prep = FlexPrep(num_tokens=x_TH.shape[0], exchange=exchange, pad_to_capacity=routing.pad_to_capacity,
                        capacity=routing.capacity, with_probs=with_probs)
        return (x_TH, probs_TK), prep

    def dispatch_exchange(self, prep: FlexPrep) -> FlexDispatchExchange:
        return prep.exchange

    def finish_dispatch(self, received: tuple[Tensor, ...], meta: FlexLayout, prep: FlexPrep,
                        ) -> Dispatched[FlexHandle]:
        recv_x, recv_w = received
        e, per_expert, T = self.num_local_experts, list(meta.per_expert), prep.num_tokens
        with self._phase("permute"):
            R, Kv = meta.recv_idx.shape
            key = mask_groups(meta.recv_idx, e)
            if prep.pad_to_capacity:
                # each of the etp*ep source ranks sent at most its own capacity per expert; with this
                # rank's as the bound, a source with more tokens (a larger capacity) could overflow the
                # padded chunk. The received counts are on the host already.
                rows_per_expert = int(prep.capacity) * self.ep * self.etp
                if max(per_expert, default=0) > rows_per_expert:
                    raise ValueError(
                        f"flex dispatch with pad_expert_input_to_capacity: a local expert received "
                        f"{max(per_expert)} copies, more than capacity {prep.capacity} x ep*etp "
                        f"{self.ep * self.etp} = {rows_per_expert} (this rank has T={T} tokens): padded mode "
                        f"needs the same token count on every rank; use dropless or unpadded capacity mode")
                row_map = build_row_map(key, R, Kv, e, capacity=rows_per_expert)
                counts_host = (rows_per_expert,) * e
            else:
                row_map = build_row_map(key, R, Kv, e, num_rows=sum(per_expert))
                counts_host = tuple(per_expert)
            tokens = permute(recv_x, row_map)
            # each row's weight from its received token's [R, Kv] top-k weights (0 for padding rows)
            probs_N = permute_probs(recv_w, row_map) if prep.with_probs else None
        handle = FlexHandle(num_tokens=T, num_rows=tokens.shape[0], row_map=row_map,
                            deep_ep_handle=meta.deep_ep_handle, buffer=prep.exchange.buffer)
        return Dispatched(tokens, row_map.counts_G, handle, counts_host, probs_N=probs_N)

    def prepare_combine(self, expert_out_NH: Tensor, handle: FlexHandle) -> tuple[Tensor, ...]:
        self._check_combine(expert_out_NH, handle, FlexHandle)
        with self._phase("unpermute"):
            # the received token's copies (weighted by the experts) summed here, on the expert rank: DeepEP's normal
            # combine adds the rows it brings home without weights. The sum is fp32 (combine_dtype) and rounded to
            # bf16 for DeepEP, whose combine kernel adds the ranks' rows in fp32 registers (v1.2.1
            # csrc/kernels/intranode.cu: float values[])
            return (unpermute(expert_out_NH, handle.row_map).to(torch.bfloat16),)

    def combine_exchange(self, handle: FlexHandle) -> FlexCombineExchange:
        return FlexCombineExchange(handle.buffer, handle.deep_ep_handle)

    def finish_combine(self, received: tuple[Tensor, ...], handle: FlexHandle) -> Tensor:
        return received[0]
