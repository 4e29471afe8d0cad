"""``build_dispatcher(config, num_experts, dims)``: the dispatcher a ``DispatchConfig`` asks for.

A mapping from ``DispatcherKind`` to a builder, and for the flex dispatcher from its resolved ``FlexBackend`` to
the DeepEP backend's class (imported only when asked for: it imports ``deep_ep``). ``FlexOptions`` reach the flex
dispatchers as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from moefold.dispatch.allgather import AllGatherDispatcher
from moefold.dispatch.alltoall import AllToAllDispatcher
from moefold.dispatch.base import PhaseTimer, TokenDispatcher
from moefold.dispatch.config import DispatchConfig, DispatcherKind
from moefold.dispatch.flex_backend import FlexBackend, resolve_flex_backend
from moefold.dispatch.local import LocalDispatcher
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group, group_size


@dataclass(frozen=True)
class DispatcherInputs:
    """What a dispatcher is built for besides its config: the expert count and groups (the etp x ep group carries
    the exchange), the token rows' hidden size, the experts' row alignment and whether their GEMMs read host
    counts (the flex dispatcher on DeepEP V2 sizes and lays out its receive buffers by them), a phase timer
    (benchmarks) and DeepEP buffers of their own (tests; None: the process's)."""

    num_experts: int
    ep_group: Group
    etp_group: Group
    etp_ep_group: Group
    hidden_size: int | None = None
    expert_alignment: int = 1
    experts_read_host_counts: bool = False
    timer: PhaseTimer | None = None
    buffers: object = None


def _local(config: DispatchConfig, i: DispatcherInputs) -> TokenDispatcher:
    config.check_layout(group_size(i.ep_group), group_size(i.etp_group))
    return LocalDispatcher(i.num_experts, timer=i.timer, fp8=config.fp8)


def _allgather(config: DispatchConfig, i: DispatcherInputs) -> TokenDispatcher:
    return AllGatherDispatcher(i.num_experts, i.ep_group, i.etp_group, i.etp_ep_group, timer=i.timer, fp8=config.fp8)


def _alltoall(config: DispatchConfig, i: DispatcherInputs) -> TokenDispatcher:
    return AllToAllDispatcher(i.num_experts, i.ep_group, i.etp_group, i.etp_ep_group, timer=i.timer, fp8=config.fp8,
                              max_chunked_experts=config.max_chunked_experts)


def _deepep(config: DispatchConfig, i: DispatcherInputs) -> TokenDispatcher:
    from moefold.dispatch.deepep_elastic import ElasticFlexDispatcher  # lazy: imports deep_ep

    return ElasticFlexDispatcher(i.num_experts, i.ep_group, i.etp_group, i.etp_ep_group, timer=i.timer,
                                 options=config.flex, hidden_size=i.hidden_size, expert_alignment=i.expert_alignment,
                                 experts_read_host_counts=i.experts_read_host_counts, fp8=config.fp8,
                                 buffers=i.buffers)


def _deepep_legacy(config: DispatchConfig, i: DispatcherInputs) -> TokenDispatcher:
    from moefold.dispatch.deepep import FlexDispatcher  # lazy: imports deep_ep

    return FlexDispatcher(i.num_experts, i.ep_group, i.etp_group, i.etp_ep_group, timer=i.timer,
                          options=config.flex, buffers=i.buffers)


_FLEX: dict[FlexBackend, Callable[[DispatchConfig, DispatcherInputs], TokenDispatcher]] = {
    FlexBackend.DEEPEP: _deepep, FlexBackend.DEEPEP_LEGACY: _deepep_legacy}


def _flex(config: DispatchConfig, i: DispatcherInputs) -> TokenDispatcher:
    # AUTO becomes the installed DeepEP's backend; the config made again checks what that backend refuses
    backend = resolve_flex_backend(config.flex.backend)
    config = dataclasses.replace(config, flex=dataclasses.replace(config.flex, backend=backend))
    return _FLEX[backend](config, i)


_BUILDERS: dict[DispatcherKind, Callable[[DispatchConfig, DispatcherInputs], TokenDispatcher]] = {
    DispatcherKind.LOCAL: _local, DispatcherKind.ALLGATHER: _allgather, DispatcherKind.ALLTOALL: _alltoall,
    DispatcherKind.FLEX: _flex}


def build_dispatcher(config: DispatchConfig, num_experts: int, dims: ParallelDims | None = None, *,
                     ep_group: Group = None, etp_group: Group = None, etp_ep_group: Group = None,
                     hidden_size: int | None = None, expert_alignment: int = 1, experts_read_host_counts: bool = False,
                     timer: PhaseTimer | None = None, buffers: object = None) -> TokenDispatcher:
    """The dispatcher ``config`` asks for, for ``num_experts`` experts.

    Groups come from ``dims`` (its ep, etp and etp_ep groups) or are passed explicitly; with neither, the
    dispatcher runs alone (ep = etp = 1). The rest: ``DispatcherInputs``.
    """
    if dims is not None:
        ep_group, etp_group, etp_ep_group = dims.ep_group, dims.etp_group, dims.etp_ep_group
    inputs = DispatcherInputs(num_experts, ep_group, etp_group, etp_ep_group, hidden_size, expert_alignment,
                              experts_read_host_counts, timer, buffers)
    # kind None (--moe-token-dispatcher-type auto): the layout's, read from the groups
    return _BUILDERS[config.kind_for(group_size(ep_group), group_size(etp_group))](config, inputs)


__all__ = ["DispatcherInputs", "build_dispatcher"]
