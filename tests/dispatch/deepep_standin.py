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

Preconditions: every check DeepEP v1.2.1 makes on what moefold passes is made here too, each citing its
line (``deep_ep.cpp`` is ``csrc/deep_ep.cpp``, ``intranode.cu`` ``csrc/kernels/intranode.cu``, ``launch.cuh``
``csrc/kernels/launch.cuh``, ``buffer.py`` ``deep_ep/buffer.py``, all at tag v1.2.1). A host assert
(``EP_HOST_ASSERT``) raises ``RuntimeError("Failed: Assertion error FILE:LINE 'COND'")`` as DeepEP's
``EPException`` does; a device assert (``EP_DEVICE_ASSERT``) traps the kernel on a GPU (the rank dies and its
peers hang): here it raises ``DeviceAssert``. ``PRECONDITIONS`` lists them (tests/test_standins.py checks each).
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
NUM_MAX_LOCAL_EXPERTS = 1024   # csrc/kernels/configs.cuh:6


class DeviceAssert(RuntimeError):
    """A DeepEP kernel's ``EP_DEVICE_ASSERT`` (csrc/kernels/exception.cuh:44): a trap on a GPU."""


def _host_assert(ok: bool, where: str, cond: str) -> None:
    """DeepEP's ``EP_HOST_ASSERT`` (csrc/kernels/exception.cuh:35-40): an ``EPException`` naming file, line, cond."""
    if not ok:
        raise RuntimeError(f"Failed: Assertion error {where} '{cond}'")


def _device_assert(ok: bool, where: str, cond: str) -> None:
    if not ok:
        raise DeviceAssert(f"device-side assert {where} '{cond}' (on a GPU the kernel traps: the rank dies)")


def _comm_stream_args(previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool, where: str) -> None:
    """Allocating on DeepEP's stream needs an event to wait on and an asynchronous finish."""
    _host_assert(not allocate_on_comm_stream or (previous_event is not None and async_finish), where,
                 "previous_event.has_value() and async")


def _int64_topk(topk_idx: torch.Tensor, where: str) -> None:
    """``topk_idx.data_ptr<int64_t>()``: torch raises for another dtype."""
    if topk_idx.dtype != torch.int64:
        raise RuntimeError(f"expected scalar type Long but found {topk_idx.dtype} ({where}: data_ptr<int64_t>)")


# What the real library rejects and the stand-in with it: (what, DeepEP v1.2.1 file:line). tests/test_standins.py
# passes each of these to the stand-in and expects the rejection.
PRECONDITIONS: tuple[tuple[str, str], ...] = (
    ("num_topk <= 32 in dispatch", "csrc/kernels/intranode.cu:187 (internode.cu:408)"),
    ("num_topk <= 32 in combine", "csrc/kernels/intranode.cu:592 (internode.cu:1393)"),
    ("allocate_on_comm_stream needs previous_event and async_finish: layout", "csrc/deep_ep.cpp:253"),
    ("allocate_on_comm_stream needs previous_event and async_finish: dispatch", "csrc/deep_ep.cpp:391"),
    ("allocate_on_comm_stream needs previous_event and async_finish: combine", "csrc/deep_ep.cpp:569"),
    ("topk_idx int64: layout", "csrc/deep_ep.cpp:272"),
    ("topk_idx int64: dispatch", "csrc/deep_ep.cpp:369"),
    ("topk_idx 2-D contiguous: layout", "csrc/deep_ep.cpp:245-246"),
    ("topk_idx and topk_weights 2-D contiguous: dispatch", "csrc/deep_ep.cpp:364-365"),
    ("topk_weights fp32: dispatch", "csrc/deep_ep.cpp:368"),
    ("topk_weights fp32: combine", "csrc/deep_ep.cpp:587"),
    ("x 2-D contiguous: dispatch", "csrc/deep_ep.cpp:336"),
    ("x 2-D contiguous: combine", "csrc/deep_ep.cpp:547"),
    ("hidden bytes a multiple of 16: dispatch", "csrc/deep_ep.cpp:337"),
    ("bf16 dispatch input", "deep_ep/buffer.py:323-324 (docstring: 'type must be torch.bfloat16')"),
    ("bf16 combine input", "csrc/kernels/intranode.cu:927 -> launch.cuh:81-85 (SWITCH_TYPES: CUDA_R_16BF only)"),
    ("an even SM count", "deep_ep/buffer.py:152, csrc/deep_ep.cpp:315 and 554"),
    ("num_experts a multiple of the ranks, <= 1024 per rank", "csrc/deep_ep.cpp:347-348"),
    ("destroy() needs explicitly_destroy=True", "deep_ep/buffer.py:133"),
    ("destroy() once", "csrc/deep_ep.cpp:144"),
)


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
        self.explicitly_destroy, self.destroyed = explicitly_destroy, False
        dist.barrier(group=group)  # creating a buffer is collective (DeepEP all-gathers IPC handles)
        Buffer.instances.append(self)

    def destroy(self) -> None:
        """``Buffer.destroy()`` (buffer.py:127-137): only with ``explicitly_destroy`` (buffer.py:133), once
        (deep_ep.cpp:144); collective: it synchronises the device and barriers the group (deep_ep.cpp:147-151)."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        _host_assert(not self.destroyed, "csrc/deep_ep.cpp:144", "not destroyed")
        dist.barrier(group=self.group)
        self.destroyed = True

    def _alive(self) -> None:
        assert not self.destroyed, "the buffer was destroyed (its runtime is None)"

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"   # buffer.py:152
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
        self._alive()
        assert previous_event is None or isinstance(previous_event, EventOverlap), type(previous_event)
        _host_assert(Buffer.num_sms % 2 == 0, "csrc/deep_ep.cpp:315", "config.num_sms % 2 == 0")
        where = {"get_dispatch_layout": "csrc/deep_ep.cpp:253", "dispatch": "csrc/deep_ep.cpp:391",
                 "combine": "csrc/deep_ep.cpp:569"}[name]
        _comm_stream_args(previous_event, async_finish, allocate_on_comm_stream, where)
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
        _host_assert(topk_idx.dim() == 2, "csrc/deep_ep.cpp:245", "topk_idx.dim() == 2")
        _host_assert(topk_idx.is_contiguous(), "csrc/deep_ep.cpp:246", "topk_idx.is_contiguous()")
        _host_assert(num_experts > 0, "csrc/deep_ep.cpp:247", "num_experts > 0")
        _int64_topk(topk_idx, "csrc/deep_ep.cpp:272")
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
        _host_assert(x.dim() == 2 and x.is_contiguous(), "csrc/deep_ep.cpp:336", "x.dim() == 2 and x.is_contiguous()")
        _host_assert(x.size(1) * x.element_size() % 16 == 0, "csrc/deep_ep.cpp:337",
                     "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        assert x.dtype == torch.bfloat16, f"dispatch x must be torch.bfloat16 (buffer.py:323-324), got {x.dtype}"
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
            _host_assert(is_token_in_rank.dtype == torch.bool, "csrc/deep_ep.cpp:326",
                         "is_token_in_rank.scalar_type() == torch::kBool")
            _host_assert(num_tokens_per_expert.dtype == num_tokens_per_rank.dtype == torch.int32,
                         "csrc/deep_ep.cpp:331-332", "num_tokens_per_expert/rank->scalar_type() == torch::kInt32")
            _host_assert(num_tokens_per_expert.shape[0] % R == 0, "csrc/deep_ep.cpp:347",
                         "num_tokens_per_expert->size(0) % num_ranks == 0")
            _host_assert(num_tokens_per_expert.shape[0] // R <= NUM_MAX_LOCAL_EXPERTS, "csrc/deep_ep.cpp:348",
                         "num_tokens_per_expert->size(0) / num_ranks <= NUM_MAX_LOCAL_EXPERTS")
            for t in (topk_idx, topk_weights):
                _host_assert(t.dim() == 2 and t.is_contiguous(), "csrc/deep_ep.cpp:364-365",
                             "topk_idx/topk_weights->dim() == 2 and ->is_contiguous()")
            assert topk_idx.shape == topk_weights.shape == (x.shape[0], topk_idx.shape[1])
            _host_assert(topk_weights.dtype == torch.float32, "csrc/deep_ep.cpp:368",
                         "topk_weights->scalar_type() == torch::kFloat32")
            _int64_topk(topk_idx, "csrc/deep_ep.cpp:369")
            _device_assert(topk_idx.shape[1] <= 32, "csrc/kernels/intranode.cu:187", "num_topk <= 32")
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
            counts = torch.stack([(recv_idx == j).sum() for j in range(e)]) if e else torch.zeros(0)
            new_handle = (send_index, send, recv, is_token_in_rank, T, None)
            (recv_x, recv_idx, recv_w), event = self._finish(
                [(recv_x, float("nan")), (recv_idx, -7), (recv_w, float("nan"))], async_finish)
        # the host waits for the received counts (deep_ep.cpp:449-467, the CPU spinning on moe_recv_counter and
        # moe_recv_expert_counter): modelled by one read of a device tensor outside HOST_WORK, so a HostSyncCounter
        # counts it as the one host synchronisation this dispatch makes
        per_expert = counts.tolist()
        return recv_x, recv_idx, recv_w, per_expert, new_handle, event

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self._record("combine", previous_event, async_finish, allocate_on_comm_stream)
        _host_assert(x.dim() == 2 and x.is_contiguous(), "csrc/deep_ep.cpp:547", "x.dim() == 2 and x.is_contiguous()")
        _host_assert(x.dtype == torch.bfloat16, "csrc/kernels/launch.cuh:84 (intranode.cu:927)",
                     "false and \"Unsupported type\"")
        assert bias is None, "bias is not modelled"
        if topk_weights is not None:
            _host_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "csrc/deep_ep.cpp:585",
                         "topk_weights->dim() == 2 and topk_weights->is_contiguous()")
            _host_assert(topk_weights.dtype == torch.float32, "csrc/deep_ep.cpp:587",
                         "topk_weights->scalar_type() == torch::kFloat32")
            _device_assert(topk_weights.shape[1] <= 32, "csrc/kernels/intranode.cu:592", "num_topk <= 32")
        send_index, send, recv, _, num_tokens, _ = handle
        with HOST_WORK():
            assert x.shape[0] == sum(recv), (x.shape, recv)
            back = self._exchange(x.float(), recv, send)
            y = torch.zeros(num_tokens, x.shape[1]).index_add_(0, send_index, back).to(torch.bfloat16)
            results: list[tuple[torch.Tensor, float | int]] = [(y, float("nan"))]
            if topk_weights is not None:
                assert topk_weights.shape[0] == x.shape[0]
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
