"""Every token dispatcher implements the six stages of ``dispatch.base.Dispatcher``, typed, and the builder makes each
one from its ``DispatchConfig``.

The stages are the only form of a dispatch and a combine (the MoE layer and the overlap schedules run them): a
dispatcher class defines all six itself (the base class has none to inherit, so none raises ``NotImplementedError``),
and what crosses from stage to stage is typed per dispatcher: its ``DispatchPrep`` and ``DispatchHandle`` subclasses
and its dispatch exchange's ``Arrival.meta`` type, never ``Any``.
"""

from __future__ import annotations

import inspect
import sys
import typing

import pytest

from moefold.dispatch import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    DispatchConfig,
    Dispatcher,
    DispatcherKind,
    DispatchHandle,
    DispatchPrep,
    FlexBackend,
    FlexOptions,
    LocalDispatcher,
    TokenDispatcher,
    build_dispatcher,
)
from moefold.dispatch.deepep import FlexDispatcher
from moefold.dispatch.deepep_elastic import ElasticFlexDispatcher
from moefold.dispatch.token_exchange import TokenExchange
from tests.dispatch import deepep_elastic_standin, deepep_standin
from tests.distributed import run_distributed

STAGES = ("prepare_dispatch", "dispatch_exchange", "finish_dispatch", "prepare_combine", "combine_exchange",
          "finish_combine")
DISPATCHERS = (LocalDispatcher, AllToAllDispatcher, AllGatherDispatcher, FlexDispatcher, ElasticFlexDispatcher)


def _all_dispatchers(cls: type = TokenDispatcher) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_dispatchers(sub)
    return out


def _is_any(hint: object) -> bool:
    return hint is typing.Any or any(_is_any(a) for a in typing.get_args(hint))


def test_every_dispatcher_is_listed_here():
    assert _all_dispatchers() == set(DISPATCHERS)


@pytest.mark.parametrize("cls", DISPATCHERS, ids=lambda c: c.__name__)
def test_every_dispatcher_implements_every_stage_typed(cls):
    for name in STAGES:
        assert not hasattr(TokenDispatcher, name), f"TokenDispatcher.{name}: a default every dispatcher would inherit"
        assert callable(getattr(cls, name, None)), f"{cls.__name__} has no {name}"
    hints = {name: typing.get_type_hints(getattr(cls, name)) for name in STAGES}
    for name, h in hints.items():
        assert not any(_is_any(v) for v in h.values()), f"{cls.__name__}.{name}: Any in {h}"
    prep = typing.get_args(hints["prepare_dispatch"]["return"])[1]
    assert issubclass(prep, DispatchPrep) and prep is not DispatchPrep, prep
    assert hints["dispatch_exchange"]["prep"] is prep and hints["finish_dispatch"]["prep"] is prep
    exchange = hints["dispatch_exchange"]["return"]
    meta = hints["finish_dispatch"]["meta"]
    # the exchange's Arrival.meta is the type finish_dispatch reads
    bases = [b for b in getattr(exchange, "__orig_bases__", ()) if typing.get_origin(b) is TokenExchange]
    assert issubclass(exchange, TokenExchange) and [typing.get_args(b)[0] for b in bases] == [meta], (exchange, meta)
    handle = typing.get_args(hints["finish_dispatch"]["return"])[0]
    assert issubclass(handle, DispatchHandle) and handle is not DispatchHandle, handle
    for name in ("prepare_combine", "combine_exchange", "finish_combine"):
        assert hints[name]["handle"] is handle, (name, hints[name])
    combine = hints["combine_exchange"]["return"]
    assert issubclass(combine, TokenExchange) and not inspect.isabstract(combine)


def test_the_builder_makes_each_kind_from_its_config():
    for kind, cls in ((DispatcherKind.LOCAL, LocalDispatcher), (DispatcherKind.ALLGATHER, AllGatherDispatcher),
                      (DispatcherKind.ALLTOALL, AllToAllDispatcher)):
        d = build_dispatcher(DispatchConfig(kind, fp8=True, max_chunked_experts=3), 8)
        assert type(d) is cls and d.kind is kind and d.fp8 and isinstance(d, Dispatcher)
    with pytest.raises(ValueError, match="dispatcher='local' needs ep\\*etp=1, got ep=1 etp=2"):
        DispatchConfig(DispatcherKind.LOCAL).check_layout(1, 2)


def _flex_world() -> list[str]:
    from moefold.dispatch.deepep import DeepEPBuffers
    from moefold.dispatch.deepep_elastic import ElasticBuffers
    from moefold.parallel import ParallelConfig, ParallelDims

    dims = ParallelDims.build(ParallelConfig(ep=2))
    failures = []
    sys.modules["deep_ep"] = deepep_elastic_standin.module()   # DeepEP 2.x: ElasticBuffer and the legacy Buffer
    for backend, cls in ((FlexBackend.AUTO, ElasticFlexDispatcher), (FlexBackend.DEEPEP, ElasticFlexDispatcher),
                         (FlexBackend.DEEPEP_LEGACY, FlexDispatcher)):
        v2 = cls is ElasticFlexDispatcher   # (hybrid False: a V2 setting the legacy backend refuses)
        flex = FlexOptions(backend, num_sms=24, max_tokens_per_rank=16, hybrid=not v2, cpu_sync=None)
        for reads_host_counts in (False, True):
            d = build_dispatcher(DispatchConfig(DispatcherKind.FLEX, flex), 8, dims, hidden_size=32,
                                 experts_read_host_counts=reads_host_counts,
                                 buffers=DeepEPBuffers() if cls is FlexDispatcher else ElasticBuffers())
            got = (type(d), d.num_sms)
            if cls is ElasticFlexDispatcher:   # the options as given; cpu_sync None: the experts' choice
                got += (d.max_tokens_per_rank, d.hybrid, d.cpu_sync)
                want = (cls, 24, 16, False, reads_host_counts)
            else:
                want = (cls, 24)
            if got != want:
                failures.append(f"{backend}: built {got}, expected {want}")
    sys.modules["deep_ep"] = deepep_standin.module()   # DeepEP v1: AUTO is the legacy backend
    d = build_dispatcher(DispatchConfig(DispatcherKind.FLEX), 8, dims, hidden_size=32, buffers=DeepEPBuffers())
    if type(d) is not FlexDispatcher or d.num_sms != 20:
        failures.append(f"auto on DeepEP v1: {type(d).__name__} with {d.num_sms} SMs")
    try:
        build_dispatcher(DispatchConfig(DispatcherKind.FLEX, fp8=True), 8, dims, hidden_size=32)
        failures.append("FP8 dispatch on the legacy backend (AUTO resolved to it) was not refused")
    except ValueError as exc:
        if "not on deepep-legacy" not in str(exc):
            failures.append(f"FP8 dispatch on legacy: {exc}")
    return failures


def test_the_builder_makes_the_flex_dispatcher_of_its_options():
    failures = sorted({f for rank in run_distributed(_flex_world, 2, timeout=120) for f in rank})
    assert not failures, "\n".join(failures)


def test_choices_are_checked_in_their_config_once():
    with pytest.raises(ValueError, match=r"unknown dispatcher kind 'nccl' \(dispatcher='nccl'"):
        DispatchConfig("nccl")
    with pytest.raises(ValueError, match="--moe-flex-dispatcher-backend='v3'"):
        FlexOptions("v3")
    with pytest.raises(ValueError, match="deepep_num_sms=5 must be an even"):
        FlexOptions(num_sms=5)
    with pytest.raises(ValueError, match=r"--moe-deepep-mode direct .*DeepEP V2 settings"):
        DispatchConfig(DispatcherKind.FLEX, FlexOptions(FlexBackend.DEEPEP_LEGACY, hybrid=False))
    # the same options outside the flex dispatcher are not its business
    assert DispatchConfig(DispatcherKind.ALLTOALL, FlexOptions(FlexBackend.DEEPEP_LEGACY, hybrid=False))
    config = DispatchConfig("allgather", FlexOptions("deepep"))   # strings (a flag, YAML) become the enums
    assert config.kind is DispatcherKind.ALLGATHER and config.flex.backend is FlexBackend.DEEPEP
