"""The flex dispatcher: DeepEP's fused NVLink/RDMA all-to-all kernels (``deep_ep.Buffer``) over ep.

DeepEP moves each *token* once per destination rank (not once per copy) and returns, per received
token, its top-k expert ids translated to local ids (-1 where the expert lives elsewhere). We then
permute locally into expert-major rows, exactly like the other dispatchers, so the experts see the
same ``Dispatched`` contract. Autograd: dispatch's backward is DeepEP's combine of the gradients
(with the top-k weight gradients reduced alongside) and combine's backward is a cached-layout
dispatch, as in DeepEP's own training examples.

``deep_ep`` is imported lazily: choosing ``flex`` without it fails at construction. It needs
NVIDIA GPUs, NVSHMEM for inter-node runs, and bf16 tokens. Expert tensor parallelism (etp > 1)
is not supported here; use the alltoall dispatcher for etp > 1.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moefold.dispatch.base import Dispatched, DispatchHandle, PendingDispatch, PhaseTimer, TokenDispatcher
from moefold.dispatch.permutation import RowMap, build_row_map, mask_groups, permute, permute_probs, unpermute
from moefold.moe.routing import Routing
from moefold.parallel.groups import Group

INSTALL_HINT = ("the flex dispatcher needs DeepEP: `pip install deep-ep` (built from "
                "https://github.com/deepseek-ai/DeepEP; it needs CUDA GPUs and NVSHMEM)")


def import_deep_ep() -> Any:
    """Import ``deep_ep`` or raise ImportError saying what to install."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


class _DeepEPDispatch(torch.autograd.Function):
    """Forward: ``buffer.dispatch`` of tokens + top-k weights. Backward: ``buffer.combine`` of both grads."""

    @staticmethod
    def forward(ctx, x: Tensor, weights_TK: Tensor, topk_idx: Tensor, buffer: Any, num_experts: int):
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, recv_per_expert, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights_TK)
        ctx.buffer, ctx.handle, ctx.device = buffer, handle, x.device
        ctx.recv_shape, ctx.recv_w_shape = tuple(recv_x.shape), tuple(recv_w.shape)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w, handle, list(recv_per_expert)

    @staticmethod
    def backward(ctx, grad_x: Tensor | None, _grad_idx: Any, grad_w: Tensor | None, *_unused: Any):
        if grad_x is None:
            grad_x = torch.zeros(ctx.recv_shape, dtype=torch.bfloat16, device=ctx.device)
        if grad_w is None:
            grad_w = torch.zeros(ctx.recv_w_shape, dtype=torch.float32, device=ctx.device)
        grad_in, grad_w_in, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle,
                                                   topk_weights=grad_w.float().contiguous())
        return grad_in, grad_w_in, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """Forward: ``buffer.combine`` (sum of every rank's rows per token). Backward: cached ``buffer.dispatch``."""

    @staticmethod
    def forward(ctx, y_recv: Tensor, buffer: Any, handle: Any) -> Tensor:
        ctx.buffer, ctx.handle = buffer, handle
        y, _, _ = buffer.combine(y_recv.contiguous(), handle)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_recv, _, _, _, _, _ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return grad_recv, None, None


@dataclass(frozen=True)
class FlexHandle(DispatchHandle):
    """row_map: the local permutation of received tokens; deep_ep_handle: DeepEP's layout for combine."""

    row_map: RowMap
    deep_ep_handle: Any


class FlexDispatcher(TokenDispatcher):
    """DeepEP-backed dispatcher over ``ep_group`` (NVLink intra-node, RDMA inter-node).

    ``num_nvl_bytes`` / ``num_rdma_bytes`` size DeepEP's communication buffers (allocated once,
    collectively, at construction); ``num_rdma_bytes`` must be > 0 when ep spans nodes.
    """

    name = "flex"

    def __init__(self, num_experts: int, ep_group: Group = None, etp_group: Group = None,
                 timer: PhaseTimer | None = None, num_nvl_bytes: int = 1 << 30, num_rdma_bytes: int = 0):
        deep_ep = import_deep_ep()
        super().__init__(num_experts, ep_group, etp_group, timer)
        if not torch.cuda.is_available():
            raise RuntimeError("the flex (DeepEP) dispatcher needs CUDA GPUs; use 'alltoall' on CPU")
        if self.etp != 1:
            raise ValueError(f"the flex dispatcher supports etp=1 only, got etp={self.etp}; use 'alltoall'")
        if ep_group is None:
            raise ValueError("the flex dispatcher needs an initialised ep process group (NCCL)")
        self.buffer = deep_ep.Buffer(ep_group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes)

    def dispatch_start(self, x_TH: Tensor, routing: Routing) -> PendingDispatch:
        self._check(x_TH, routing)
        if x_TH.dtype != torch.bfloat16:
            raise ValueError(f"the flex dispatcher moves bf16 tokens, got x of dtype {x_TH.dtype}")
        e = self.num_local_experts
        topk_idx = routing.expert_ids_TK.long()
        if routing.keep_TK is not None:  # DeepEP skips -1 entries: dropped copies are never sent
            topk_idx = topk_idx.masked_fill(~routing.keep_TK.bool(), -1)
        with self._phase("communicate"):
            recv_x, recv_idx, recv_w, ep_handle, per_expert = _DeepEPDispatch.apply(
                x_TH, routing.probs_TK.float().contiguous(), topk_idx.contiguous(), self.buffer, self.num_experts)
        with self._phase("permute"):
            R, K = recv_idx.shape
            key = mask_groups(recv_idx, e)
            if routing.pad_to_capacity:
                # each source rank sent at most its own capacity per expert; with this rank's as the
                # bound, a source with more tokens (a larger capacity) could overflow the padded
                # chunk and lose copies silently. The received counts are on the host already.
                rows_per_expert = int(routing.capacity) * self.ep
                if max(per_expert, default=0) > rows_per_expert:
                    raise ValueError(
                        f"flex dispatch with pad_expert_input_to_capacity: a local expert received "
                        f"{max(per_expert)} copies, more than capacity {routing.capacity} x ep {self.ep} = "
                        f"{rows_per_expert} (this rank has T={x_TH.shape[0]} tokens): padded mode needs the "
                        f"same token count on every ep rank; use dropless or unpadded capacity mode")
                row_map = build_row_map(key, R, K, e, capacity=rows_per_expert)
            else:
                row_map = build_row_map(key, R, K, e, num_rows=sum(per_expert))
            tokens = permute(recv_x, row_map)
            probs_N = permute_probs(recv_w, row_map)
        handle = FlexHandle(num_tokens=x_TH.shape[0], num_rows=tokens.shape[0], row_map=row_map,
                            deep_ep_handle=ep_handle)
        result = Dispatched(tokens, probs_N, row_map.counts_G, handle)
        return PendingDispatch(lambda: result)

    def combine(self, expert_out_NH: Tensor, handle: DispatchHandle) -> Tensor:
        self._check_combine(expert_out_NH, handle, FlexHandle)
        assert isinstance(handle, FlexHandle)
        with self._phase("unpermute"):
            y_recv = unpermute(expert_out_NH, handle.row_map)
        with self._phase("communicate"):
            return _DeepEPCombine.apply(y_recv, self.buffer, handle.deep_ep_handle)
