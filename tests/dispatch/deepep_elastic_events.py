"""The objects DeepEP V2's ``ElasticBuffer`` returns, for the CPU stand-in (deepep_elastic_standin.py).

``EventHandle`` (``deep_ep._C.EventHandle``: a CUDA event; the v1 stand-in's, whose pending outputs complete when it
is waited on), ``EventOverlap`` (``deep_ep/utils/event.py``) and ``EPHandle`` (``deep_ep/buffers/elastic.py:25-98``),
with DeepEP's signatures and fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.dispatch import deepep_standin as legacy
from tests.dispatch.deepep_standin import EventHandle


class EventOverlap(legacy.EventOverlap):
    """``deep_ep.utils.event.EventOverlap`` (V2): v1's, plus a hook after the wait and ``release_handle``."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        super().__init__(event, extra_tensors)
        self._release_handle_by_call = False
        self.hook_after_wait: Callable | None = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        super().current_stream_wait()
        if self.hook_after_wait is not None:
            self.hook_after_wait()
            self.hook_after_wait = None
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_handle_by_call = release_handle
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class EPHandle:
    """``deep_ep.EPHandle`` (elastic.py:25-98): the fields a dispatch fills; the stand-in keeps its own routing in
    ``_route`` (the real handle's metadata tensors, ``recv_src_metadata`` etc., have the real shapes)."""

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list, psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor, num_unaligned_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor,
                 token_metadata_at_forward: torch.Tensor | None, channel_linked_list: torch.Tensor | None):
        assert topk_idx is not None
        self.do_expand, self.num_experts, self.expert_alignment = do_expand, num_experts, expert_alignment
        self.num_max_tokens_per_rank, self.num_sms, self.topk_idx = num_max_tokens_per_rank, num_sms, topk_idx
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.recv_src_metadata, self.dst_buffer_slot_idx = recv_src_metadata, dst_buffer_slot_idx
        self.token_metadata_at_forward, self.channel_linked_list = token_metadata_at_forward, channel_linked_list
        self.num_recv_tokens, self.num_expanded_tokens = num_recv_tokens, num_expanded_tokens
        self.cached_recv_src_metadata_before_sort = None
        self._route: dict[str, Any] = {}
