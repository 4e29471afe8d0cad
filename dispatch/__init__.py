"""Moving token copies to the ranks holding their experts and back: permutation, allgather, all-to-all, DeepEP.

``Routing`` (the router's decision, what every dispatcher consumes) lives here, below ``moe``: the router
in ``moe`` produces it and the MoE layer builds its dispatcher from here, so ``dispatch`` never imports ``moe``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.dispatch.allgather import AllGatherDispatcher, AllGatherHandle
    from moefold.dispatch.alltoall import (
        AllToAllDispatcher,
        AllToAllHandle,
        ExchangePlan,
        exchange_tokens,
        return_tokens,
    )
    from moefold.dispatch.base import Dispatched, Dispatcher, DispatchHandle, DispatchPrep, PhaseTimer, TokenDispatcher
    from moefold.dispatch.config import DispatchConfig, DispatcherKind, FlexOptions
    from moefold.dispatch.factory import build_dispatcher
    from moefold.dispatch.flex_backend import FlexBackend
    from moefold.dispatch.local import LocalDispatcher
    from moefold.dispatch.permutation import (
        RowMap,
        build_row_map,
        chunk_sort_index,
        group_counts,
        mask_groups,
        permute,
        permute_probs,
        sort_chunks,
        unpermute,
    )
    from moefold.dispatch.routing import Routing
    from moefold.dispatch.token_exchange import AllToAllExchange, Arrival, InFlight, TokenExchange, exchange_with_grad

# name -> the module that defines it: loaded on first use, so that reading a config or parsing flags imports
# no more than it needs (torch only where a module computes)
_LAZY = {
    **dict.fromkeys(["AllGatherDispatcher", "AllGatherHandle"], "moefold.dispatch.allgather"),
    **dict.fromkeys(["AllToAllDispatcher", "AllToAllHandle", "ExchangePlan", "exchange_tokens", "return_tokens"],
                    "moefold.dispatch.alltoall"),
    **dict.fromkeys(["Dispatched", "Dispatcher", "DispatchHandle", "DispatchPrep", "PhaseTimer", "TokenDispatcher"],
                    "moefold.dispatch.base"),
    **dict.fromkeys(["DispatchConfig", "DispatcherKind", "FlexOptions"], "moefold.dispatch.config"),
    "build_dispatcher": "moefold.dispatch.factory",
    "FlexBackend": "moefold.dispatch.flex_backend",
    "LocalDispatcher": "moefold.dispatch.local",
    **dict.fromkeys(["RowMap", "build_row_map", "chunk_sort_index", "group_counts", "mask_groups", "permute",
                     "permute_probs", "sort_chunks", "unpermute"], "moefold.dispatch.permutation"),
    "Routing": "moefold.dispatch.routing",
    **dict.fromkeys(["AllToAllExchange", "Arrival", "InFlight", "TokenExchange", "exchange_with_grad"],
                    "moefold.dispatch.token_exchange"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Routing", "Dispatcher", "TokenDispatcher", "Dispatched", "DispatchHandle", "DispatchPrep", "PhaseTimer",
    "DispatchConfig", "DispatcherKind", "FlexOptions", "FlexBackend",
    "LocalDispatcher", "AllToAllDispatcher", "AllToAllHandle", "AllGatherDispatcher", "AllGatherHandle",
    "ExchangePlan", "exchange_tokens", "return_tokens",
    "TokenExchange", "AllToAllExchange", "InFlight", "Arrival", "exchange_with_grad",
    "build_dispatcher",
    "RowMap", "mask_groups", "group_counts", "build_row_map", "permute", "permute_probs", "unpermute",
    "chunk_sort_index", "sort_chunks",
]
