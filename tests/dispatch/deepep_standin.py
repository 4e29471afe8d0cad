"""A CPU stand-in for ``deep_ep`` (DeepEP v1.2.1's ``Buffer`` API), for protocol tests.

It checks the *protocol*, not DeepEP's numerics or speed: every method has the real signature
(argument names, defaults, keyword use, return arity copied from DeepEP v1.2.1's
``deep_ep/buffer.py``), enforces the documented dtypes and shapes, records every call, and moves
data over torch.distributed (gloo) with DeepEP's documented semantics:

- ``get_dispatch_layout``: tokens per rank / per expert, ``is_token_in_rank``;
- ``dispatch``: each token once per destination rank, received in (source rank, token) order,
  top-k ids translated to the receiver's local ids (-1 elsewhere) with weight 0 there, and the
  received count per local expert as a host list; with ``handle`` the cached layout is reused;
- ``combine``: the sum over ranks of each token's returned rows (and top-k weights).

Asynchrony is modelled: with ``async_finish=True`` the returned tensors hold NaN (ids: -7) until
the returned event's ``current_stream_wait()`` runs, as a real event guards data still being
written by DeepEP's communication stream; reading them earlier gives wrong results. Host work
of the stand-in itself runs under ``HOST_WORK`` (a test replaces it with a sync counter's
``paused``, since DeepEP's own host waits happen in its C++).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
import torch.distributed as dist

HOST_WORK: Callable[[], AbstractContextManager] = nullcontext
NUM_MAX_NVL_PEERS = 8


class EventHandle:
    """Stands for ``deep_ep_cpp.EventHandle`` (a CUDA event recorded on the current stream)."""

    def __init__(self) -> None:
        self.on_complete: list[Callable[[], None]] = []
        self.waits = 0

    def current_stream_wait(self) -> None:
        self.waits += 1
        for fn in self.on_complete:
            fn()
        self.on_complete = []


class EventOverlap:
    """``deep_ep.utils.EventOverlap`` (v1.2.1): signature and methods as DeepEP's."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


class Config:
    """``deep_ep_cpp.Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)`` with its two size hints.

    The hints follow the shape of DeepEP's formula (channels x NVL ranks x chunk tokens x bytes per
    token); the tests check that moefold asks for them and allocates their maximum, not the bytes.
    """

    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int, num_max_nvl_chunked_recv_tokens: int,
                 num_max_rdma_chunked_send_tokens: int, num_max_rdma_chunked_recv_tokens: int) -> None:
        assert num_sms >= 0 and num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens
        self.num_sms = num_sms
        self.nvl_recv, self.rdma_recv = num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        return (self.num_sms // 2) * nvl_ranks * self.nvl_recv * (hidden_bytes + 128 * 12)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        return (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS) * self.rdma_recv * (hidden_bytes + 128 * 12) * 2


def _pending(real: torch.Tensor, fill: float | int) -> tuple[torch.Tensor, Callable[[], None]]:
    """A tensor that reads ``fill`` until the returned completion copies ``real`` into it."""
    out = torch.full_like(real, fill)

    def complete() -> None:
        with torch.no_grad():
            out.copy_(real)

    return out, complete


class Buffer:
    """DeepEP v1.2.1 ``deep_ep.Buffer``: the normal (high-throughput) kernels' Python API."""

    num_sms: int = 20
    instances: ClassVar[list[Buffer]] = []  # every buffer made in this process (the tests count them)
    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []
    events: ClassVar[list[EventOverlap]] = []  # every event an async_finish call returned, in call order

    def __init__(self, group: dist.ProcessGroup | None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm: Any = None) -> None:
        assert group is not None, "the stand-in needs a torch.distributed group"
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        dist.barrier(group=group)  # creating a buffer is collective (DeepEP all-gathers IPC handles)
        Buffer.instances.append(self)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        config_map = {2: Config(Buffer.num_sms, 24, 256, 6, 128), 4: Config(Buffer.num_sms, 6, 256, 6, 128),
                      8: Config(Buffer.num_sms, 6, 256, 6, 128), 16: Config(Buffer.num_sms, 36, 288, 20, 128),
                      24: Config(Buffer.num_sms, 8, 288, 32, 128), 32: Config(Buffer.num_sms, 32, 288, 32, 128),
                      64: Config(Buffer.num_sms, 20, 288, 28, 128), 128: Config(Buffer.num_sms, 20, 560, 32, 128),
                      144: Config(Buffer.num_sms, 32, 720, 12, 128), 160: Config(Buffer.num_sms, 28, 720, 12, 128)}
        assert num_ranks in config_map, f'Unsupported number of EP ranks: {num_ranks}'
        return config_map[num_ranks]

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        config_map = {2: Config(Buffer.num_sms, 10, 256, 6, 128), 4: Config(Buffer.num_sms, 9, 256, 6, 128),
                      8: Config(Buffer.num_sms, 4, 256, 6, 128), 16: Config(Buffer.num_sms, 4, 288, 12, 128),
                      24: Config(Buffer.num_sms, 1, 288, 8, 128), 32: Config(Buffer.num_sms, 1, 288, 8, 128),
                      64: Config(Buffer.num_sms, 1, 288, 20, 128), 128: Config(Buffer.num_sms, 1, 560, 12, 128),
                      144: Config(Buffer.num_sms, 2, 720, 8, 128), 160: Config(Buffer.num_sms, 2, 720, 8, 128)}
        assert num_ranks in config_map, f'Unsupported number of EP ranks: {num_ranks}'
        return config_map[num_ranks]

    # -- helpers ---------------------------------------------------------------------------
    def _record(self, name: str, previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        assert previous_event is None or isinstance(previous_event, EventOverlap), type(previous_event)
        Buffer.calls.append((name, {"previous_event": previous_event, "async_finish": async_finish,
                                    "allocate_on_comm_stream": allocate_on_comm_stream}))

    def _finish(self, results: list[tuple[torch.Tensor, float | int]], async_finish: bool
                ) -> tuple[list[torch.Tensor], EventOverlap]:
        if not async_finish:
            return [r for r, _ in results], EventOverlap(None)
        handle = EventHandle()
        outs = []
        for real, fill in results:
            out, complete = _pending(real, fill)
            handle.on_complete.append(complete)
            outs.append(out)
        Buffer.events.append(EventOverlap(handle))
        return outs, Buffer.events[-1]

    def _exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows to ranks (``send[r]`` to rank r), received in source-rank order (all_to_all_single)."""
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=self.group)
        return out

    # -- the API -----------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self._record("get_dispatch_layout", previous_event, async_finish, allocate_on_comm_stream)
        assert topk_idx.dtype == torch.int64 and topk_idx.dim() == 2
        R = self.group_size
        assert num_experts % R == 0
        e = num_experts // R
        with HOST_WORK():
            dest = torch.where(topk_idx >= 0, topk_idx.div(e, rounding_mode="floor"), -1)
            in_rank = torch.stack([(dest == r).any(1) for r in range(R)], 1) if topk_idx.numel() else \
                torch.zeros(topk_idx.shape[0], R, dtype=torch.bool)
            per_rank = in_rank.sum(0).to(torch.int32)
            valid = topk_idx[topk_idx >= 0]
            per_expert = torch.zeros(num_experts, dtype=torch.int32).scatter_add_(
                0, valid, torch.ones_like(valid, dtype=torch.int32))
        return per_rank, None, per_expert, in_rank, EventOverlap(EventHandle() if async_finish else None)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        self._record("dispatch", previous_event, async_finish, allocate_on_comm_stream)
        assert not isinstance(x, tuple), "FP8 dispatch is not modelled"
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous(), (x.dtype, x.shape)
        R = self.group_size
        with HOST_WORK():
            if handle is not None:  # cached layout: tokens only
                assert topk_idx is None and topk_weights is None
                send_index, send, recv, _, _, _ = handle
                got = self._exchange(x.float()[send_index], send, recv).to(torch.bfloat16)
                (recv_x,), event = self._finish([(got, float("nan"))], async_finish)
                return recv_x, None, None, None, None, event
            assert num_tokens_per_rank is not None and is_token_in_rank is not None
            assert num_tokens_per_expert is not None and topk_idx is not None and topk_weights is not None
            assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
            assert topk_idx.shape == topk_weights.shape == (x.shape[0], topk_idx.shape[1])
            T = topk_idx.shape[0]
            e = num_tokens_per_expert.shape[0] // R
            send_index = torch.cat([torch.nonzero(is_token_in_rank[:, r]).reshape(-1) for r in range(R)])
            dest_of_row = torch.cat([torch.full((int(is_token_in_rank[:, r].sum()),), r) for r in range(R)])
            send = is_token_in_rank.sum(0).tolist()
            counts = torch.tensor(send, dtype=torch.int64)
            got_counts = torch.empty_like(counts)
            dist.all_to_all_single(got_counts, counts, group=self.group)
            recv = got_counts.tolist()
            idx = topk_idx[send_index]
            begin = (dest_of_row * e).unsqueeze(1)
            local = torch.where((idx >= begin) & (idx < begin + e), idx - begin, -1)
            weights = torch.where(local >= 0, topk_weights[send_index], 0.0)
            recv_x = self._exchange(x.float()[send_index], send, recv).to(torch.bfloat16)
            recv_idx = self._exchange(local, send, recv)
            recv_w = self._exchange(weights, send, recv)
            per_expert = [int((recv_idx == j).sum()) for j in range(e)]
            new_handle = (send_index, send, recv, is_token_in_rank, T, None)
            (recv_x, recv_idx, recv_w), event = self._finish(
                [(recv_x, float("nan")), (recv_idx, -7), (recv_w, float("nan"))], async_finish)
        return recv_x, recv_idx, recv_w, per_expert, new_handle, event

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self._record("combine", previous_event, async_finish, allocate_on_comm_stream)
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous(), (x.dtype, x.shape)
        assert bias is None, "bias is not modelled"
        send_index, send, recv, _, num_tokens, _ = handle
        with HOST_WORK():
            assert x.shape[0] == sum(recv), (x.shape, recv)
            back = self._exchange(x.float(), recv, send)
            y = torch.zeros(num_tokens, x.shape[1]).index_add_(0, send_index, back).to(torch.bfloat16)
            results: list[tuple[torch.Tensor, float | int]] = [(y, float("nan"))]
            if topk_weights is not None:
                assert topk_weights.dtype == torch.float32 and topk_weights.shape[0] == x.shape[0]
                back_w = self._exchange(topk_weights, recv, send)
                w = torch.zeros(num_tokens, topk_weights.shape[1]).index_add_(0, send_index, back_w)
                results.append((w, float("nan")))
            outs, event = self._finish(results, async_finish)
        return outs[0], (outs[1] if topk_weights is not None else None), event


def module() -> types.ModuleType:
    """A fresh ``deep_ep`` stand-in module (Buffer, Config, EventOverlap) with empty call logs."""
    Buffer.instances, Buffer.calls, Buffer.events, Buffer.num_sms = [], [], [], 20
    mod = types.ModuleType("deep_ep")
    mod.Buffer, mod.Config, mod.EventOverlap = Buffer, Config, EventOverlap
    mod.__version__ = "v1.2.1 stand-in (tests/dispatch/deepep_standin.py)"
    return mod
