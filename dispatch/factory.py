"""``build_dispatcher(kind, num_experts, dims)``: the one place a dispatcher kind is chosen by name."""

from __future__ import annotations

from typing import Any

from moefold.dispatch.allgather import AllGatherDispatcher
from moefold.dispatch.alltoall import AllToAllDispatcher
from moefold.dispatch.base import PhaseTimer, TokenDispatcher
from moefold.dispatch.local import LocalDispatcher
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group, group_size

DISPATCHER_KINDS = ("local", "allgather", "alltoall", "flex")


def build_dispatcher(kind: str, num_experts: int, dims: ParallelDims | None = None, *,
                     ep_group: Group = None, etp_group: Group = None, etp_ep_group: Group = None,
                     timer: PhaseTimer | None = None, fp8: bool = False, **backend_options: Any) -> TokenDispatcher:
    """Create the dispatcher ``kind`` (one of ``DISPATCHER_KINDS``) for ``num_experts`` experts.

    Groups come from ``dims`` (its ep, etp and etp_ep groups) or are passed explicitly; with
    neither, the dispatcher runs alone (ep = etp = 1). ``backend_options`` go to the alltoall
    dispatcher (``max_chunked_experts``) or the flex (DeepEP) one: ``flex_backend`` (``dispatch.flex_backend``:
    "auto", "deepep" or "deepep-legacy"), ``num_sms``, ``buffers``, and for V2 (``deepep``) ``hidden_size``,
    ``max_tokens_per_rank``, ``cpu_sync``, ``hybrid``, ``expert_alignment``.
    ``fp8``: FP8 token dispatch (``dispatch.fp8_exchange``; local, allgather, alltoall and flex on DeepEP V2).
    """
    if dims is not None:
        ep_group, etp_group, etp_ep_group = dims.ep_group, dims.etp_group, dims.etp_ep_group
    if kind not in DISPATCHER_KINDS:
        raise ValueError(f"unknown dispatcher kind {kind!r}; valid kinds are {', '.join(DISPATCHER_KINDS)}")
    if backend_options and kind not in ("alltoall", "flex"):
        raise ValueError(f"options {sorted(backend_options)} are only understood by the alltoall and flex "
                         f"dispatchers, not {kind!r}")
    if kind == "local":
        for name, group in (("ep", ep_group), ("etp", etp_group)):
            if group_size(group) != 1:
                raise ValueError(f"the local dispatcher needs {name}=1, got {name}={group_size(group)}; "
                                 "use 'alltoall' or 'allgather'")
        return LocalDispatcher(num_experts, timer=timer, fp8=fp8)
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, ep_group, etp_group, etp_ep_group, timer=timer, fp8=fp8)
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group, etp_group, etp_ep_group, timer=timer, fp8=fp8,
                                  **backend_options)
    from moefold.dispatch.flex_backend import resolve_flex_backend

    backend = resolve_flex_backend(backend_options.pop("flex_backend", "auto"))
    if backend == "deepep":
        from moefold.dispatch.deepep_elastic import ElasticFlexDispatcher  # lazy: imports deep_ep when asked for

        return ElasticFlexDispatcher(num_experts, ep_group, etp_group, etp_ep_group, timer=timer, fp8=fp8,
                                     **backend_options)
    if fp8:
        raise ValueError("FP8 dispatch runs with the local, allgather and alltoall dispatchers and the flex "
                         "dispatcher on DeepEP V2 (--moe-flex-dispatcher-backend deepep), not deepep-legacy")
    if backend_options.get("num_sms") == 0:   # 0 = the backend's default: DeepEP v1's Buffer.num_sms (Megatron's 20)
        del backend_options["num_sms"]
    from moefold.dispatch.deepep import FlexDispatcher  # lazy: imports deep_ep only when asked for

    return FlexDispatcher(num_experts, ep_group, etp_group, etp_ep_group, timer=timer, **backend_options)
