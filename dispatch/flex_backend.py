"""Which DeepEP runs the flex dispatcher (``--moe-flex-dispatcher-backend``), decided once and stated at start-up.

- ``deepep``: DeepEP V2's ``ElasticBuffer`` (``dispatch.deepep_elastic``): NCCL Gin, JIT-built kernels,
  sync-free dispatch.
- ``deepep-legacy``: DeepEP's v1 ``Buffer`` API (``dispatch.deepep``; DeepEP v1.2.1, or ``deep_ep.Buffer`` of
  DeepEP 2.x, ``deep_ep/buffers/legacy.py``): NVSHMEM, one host wait per dispatch for the received counts.
- ``auto`` (default): ``deepep`` when the installed ``deep_ep`` has ``ElasticBuffer`` (2.x), else
  ``deepep-legacy``.

The names follow Megatron-Core's ``--moe-flex-dispatcher-backend`` (whose ``deepep`` is DeepEP's v1 API;
moefold's ``deepep`` is V2 and the v1 API is ``deepep-legacy``). Megatron's other backends (HybridEP, NCCL-EP)
are not implemented.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class FlexBackend(StrEnum):
    """Which DeepEP the flex dispatcher runs (``--moe-flex-dispatcher-backend``; the values are the flag's)."""

    AUTO = "auto"
    DEEPEP = "deepep"
    DEEPEP_LEGACY = "deepep-legacy"

    @classmethod
    def _missing_(cls, value: object) -> FlexBackend:
        raise ValueError(f"--moe-flex-dispatcher-backend={value!r}; valid: {', '.join(cls)}")


def resolve_flex_backend(backend: FlexBackend) -> FlexBackend:
    """``backend`` with ``AUTO`` replaced by what the installed DeepEP runs; ImportError of one line naming what to
    install when the backend's DeepEP is missing, or the fix when it refuses torch's NCCL (``dispatch.deepep_nccl``)."""
    backend = FlexBackend(backend)
    if backend is FlexBackend.DEEPEP:
        from moefold.dispatch.deepep_elastic import import_elastic

        import_elastic()
        return backend
    if backend is FlexBackend.DEEPEP_LEGACY:
        from moefold.dispatch.deepep import import_deep_ep

        import_deep_ep()
        return backend
    from moefold.dispatch.deepep_elastic import V2_INSTALL_HINT
    from moefold.dispatch.deepep_nccl import import_deep_ep

    deep_ep = import_deep_ep(V2_INSTALL_HINT)
    return FlexBackend.DEEPEP if hasattr(deep_ep, "ElasticBuffer") else FlexBackend.DEEPEP_LEGACY


def describe_flex_backend(backend: FlexBackend, *, hybrid: bool = True, cpu_sync: bool = False,
                          num_sms: int = 0) -> str:
    """The start-up line naming the backend, the installed DeepEP and its settings (imports ``deep_ep``)."""
    from moefold.dispatch.deepep_nccl import import_deep_ep

    deep_ep: Any = import_deep_ep("the flex dispatcher needs DeepEP (docs/gpus.md)")
    version = getattr(deep_ep, "__version__", "?")
    if FlexBackend(backend) is FlexBackend.DEEPEP:
        sms = f"{num_sms} SMs" if num_sms else "SMs from ElasticBuffer.get_theoretical_num_sms"
        sync = "CPU sync for the received counts (1 host wait per dispatch)" if cpu_sync else \
            "sync-free (do_cpu_sync=False, worst-case receive buffers)"
        return (f"flex dispatcher: DeepEP {version} ElasticBuffer (--moe-flex-dispatcher-backend deepep), "
                f"{'hybrid' if hybrid else 'direct'} mode, {sync}, {sms}")
    return (f"flex dispatcher: DeepEP {version} legacy Buffer (--moe-flex-dispatcher-backend deepep-legacy), "
            f"normal kernels, 1 host wait per dispatch, {num_sms or 20} SMs")


def destroy_deepep_buffers() -> int:
    """Destroy this process's DeepEP buffers of both backends (``dispatch.deepep.BUFFERS``,
    ``dispatch.deepep_elastic.ELASTIC_BUFFERS``): collective over each buffer's group, before the process group
    goes, as a run ends normally. Returns how many were destroyed."""
    from moefold.dispatch.deepep import BUFFERS
    from moefold.dispatch.deepep_elastic import ELASTIC_BUFFERS

    return BUFFERS.destroy() + ELASTIC_BUFFERS.destroy()


def forget_deepep_buffers() -> int:
    """Drop them without DeepEP's collective destroy (a failed run: a peer may never reach it)."""
    from moefold.dispatch.deepep import BUFFERS
    from moefold.dispatch.deepep_elastic import ELASTIC_BUFFERS

    return BUFFERS.forget() + ELASTIC_BUFFERS.forget()


__all__ = ["FlexBackend", "describe_flex_backend", "destroy_deepep_buffers", "forget_deepep_buffers",
           "resolve_flex_backend"]
