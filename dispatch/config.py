"""``DispatchConfig``: which token dispatcher an MoE layer runs, with its typed options; each value checked here once.

``DispatcherKind`` names the dispatchers (``--moe-token-dispatcher-type``; the values are the flag's, so YAML, JSON
and saved configs keep their strings); ``FlexOptions`` are the flex (DeepEP) dispatcher's options, handed to its
constructor as they are (``dispatch.factory.build_dispatcher``). A string becomes its enum here, in the dataclass
(from a flag, a YAML file or a saved config); code below reads the enums. ``FlexOptions``' fields carry their flags
(Megatron-LM's names, help, choices) as field metadata, which ``training.cli.option_flags`` turns into ``moefold
train``'s flags: the flag's value lands in the field the dispatcher reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from moefold.dispatch.flex_backend import FlexBackend


class DispatcherKind(StrEnum):
    """The token dispatchers (``dispatch.local``, ``dispatch.allgather``, ``dispatch.alltoall``, the flex one on
    DeepEP: ``dispatch.deepep_elastic`` / ``dispatch.deepep``)."""

    LOCAL = "local"
    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"
    FLEX = "flex"

    @classmethod
    def _missing_(cls, value: object) -> DispatcherKind:
        raise ValueError(f"unknown dispatcher kind {value!r} (dispatcher={value!r}, --moe-token-dispatcher-type); "
                         f"valid kinds are {', '.join(cls)}")


AUTO = "auto"   # --moe-token-dispatcher-type's (and YAML's, a saved config's) word for kind None: by the layout


def dispatcher_kind(value: DispatcherKind | str | None) -> DispatcherKind | None:
    """A dispatcher kind from its text (a flag's, YAML's, JSON's): None for ``auto``; ValueError naming the valid."""
    return None if value in (None, AUTO) else DispatcherKind(value)


def dispatcher_text(kind: DispatcherKind | None) -> str:
    """``kind`` as the flag and saved configs spell it (``auto`` for None)."""
    return AUTO if kind is None else kind.value


def kind_for_layout(kind: DispatcherKind | None, ep: int, etp: int) -> DispatcherKind:
    """``kind``, or for None (``--moe-token-dispatcher-type auto``) the layout's: local when ep*etp == 1 (nothing
    travels), else alltoall."""
    if kind is not None:
        return kind
    return DispatcherKind.LOCAL if ep * etp == 1 else DispatcherKind.ALLTOALL


DEEPEP_MODES: tuple[str, ...] = ("hybrid", "direct")   # --moe-deepep-mode: FlexOptions.hybrid True / False


def deepep_hybrid(mode: str) -> bool:
    """``--moe-deepep-mode``'s text to ``FlexOptions.hybrid``."""
    if mode not in DEEPEP_MODES:
        raise ValueError(f"--moe-deepep-mode={mode!r}; valid: {', '.join(DEEPEP_MODES)}")
    return mode == "hybrid"


def deepep_mode(hybrid: bool) -> str:
    """``FlexOptions.hybrid`` as ``--moe-deepep-mode``'s text."""
    return DEEPEP_MODES[0] if hybrid else DEEPEP_MODES[1]


def _flag(default: object, flag: str, help: str, **meta: object) -> object:
    # a field that is a flag of ``moefold train`` (the metadata ``models.flag_field.flag`` writes, without importing
    # models/ from below it): training.cli.option_flags reads it
    return field(default=default, metadata={"flag": flag, "help": help, **meta})


def _positive_or_none(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive integer or None")


@dataclass(frozen=True)
class FlexOptions:
    """The flex dispatcher's options (its constructor takes them as they are).

    backend:             which DeepEP (``--moe-flex-dispatcher-backend``); ``AUTO``: the installed one, resolved when
                         the dispatcher is built
    num_sms:             SMs DeepEP's kernels take (``--moe-deepep-num-sms``): even, >= 2; 0: the backend's choice
                         (V2: ``get_theoretical_num_sms``; legacy: 20, Megatron's default)
    max_tokens_per_rank: V2: the most tokens a rank routes per call, which sizes DeepEP's buffer (the trainer sets
                         micro-batch x sequence / (tp x cp)); None before it is known
    hybrid:              V2: ``allow_hybrid_mode`` (``--moe-deepep-mode hybrid``; False: direct)
    cpu_sync:            V2: ``do_cpu_sync``, the host waits for the received counts (``--moe-deepep-cpu-sync``);
                         None: on exactly when the expert GEMMs read host counts anyway
    """

    backend: FlexBackend = _flag(   # noqa: RUF009 (a dataclasses.Field, as field() gives)
        FlexBackend.AUTO, "--moe-flex-dispatcher-backend", choices=tuple(b.value for b in FlexBackend),
        help="the flex dispatcher's DeepEP: deepep (V2 ElasticBuffer: sync-free, JIT-built kernels), deepep-legacy "
             "(the v1 Buffer API), auto (default: deepep when the installed DeepEP is V2)")
    num_sms: int = _flag(0, "--moe-deepep-num-sms", help="SMs DeepEP's kernels take (flex dispatcher; even; default 0: "
                         "DeepEP V2's get_theoretical_num_sms, 20 with deepep-legacy)")
    max_tokens_per_rank: int | None = None
    hybrid: bool = _flag(True, "--moe-deepep-mode", choices=DEEPEP_MODES, to_field=deepep_hybrid,
                         from_field=deepep_mode, help="DeepEP V2 across nodes: hybrid (default: RDMA once per "
                         "node, forwarded over NVLink) or direct (RDMA to every destination rank)")
    cpu_sync: bool | None = _flag(
        None, "--moe-deepep-cpu-sync", action="optional",
        help="DeepEP V2: the host waits for the received counts (exact receive buffers, one host sync per dispatch) "
             "instead of worst-case-sized ones; default: on exactly when the expert GEMMs take host counts anyway "
             "(te, grouped_gemm, loop, FP8)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", FlexBackend(self.backend))
        sms = self.num_sms
        if not isinstance(sms, int) or isinstance(sms, bool) or sms < 0 or sms == 1 or sms % 2:
            raise ValueError(f"deepep_num_sms={sms!r} must be an even integer >= 2, or 0 for the backend's choice "
                             "(--moe-deepep-num-sms; DeepEP runs two SMs per channel)")
        _positive_or_none("deepep_max_tokens_per_rank", self.max_tokens_per_rank)

    def cpu_sync_for(self, experts_read_host_counts: bool) -> bool:
        """V2's ``do_cpu_sync``: as set, or (None) on exactly when the expert GEMMs read host counts anyway, which
        DeepEP's wait then gives them."""
        return experts_read_host_counts if self.cpu_sync is None else self.cpu_sync


@dataclass(frozen=True)
class DispatchConfig:
    """How an MoE layer's token copies travel; ``ModelOptions.dispatch`` holds the run's, handed to every MoE layer's
    dispatcher unchanged (``models.options.auto_dispatch`` its default: kind None).

    kind:                the dispatcher (``--moe-token-dispatcher-type``; ``auto`` given is None); None: chosen by
                         the layout when it is built (``kind_for_layout``: local at ep*etp == 1, else alltoall)
    flex:                the flex dispatcher's options (read only by it)
    fp8:                 FP8 token dispatch (``--moe-fp8-dispatch``: e4m3 rows with per-128-channel scales,
                         ``dispatch.fp8_exchange``)
    max_chunked_experts: alltoall at etp = 1: one all-to-all per local expert while a rank holds at most this many
                         (rows land expert-major), else one exchange and a sort; 0: never chunked
    """

    kind: DispatcherKind | None = _flag(   # noqa: RUF009 (a dataclasses.Field, as field() gives)
        DispatcherKind.ALLTOALL, "--moe-token-dispatcher-type", from_field=dispatcher_text,
        choices=(AUTO, *(k.value for k in DispatcherKind)),
        help="how tokens reach their experts: auto (local without ep/etp, else alltoall), allgather, alltoall, flex "
             "(DeepEP, CUDA)")
    flex: FlexOptions = field(default_factory=FlexOptions)
    fp8: bool = False
    max_chunked_experts: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", dispatcher_kind(self.kind))
        if isinstance(self.flex, dict):   # the nested form read back from JSON / YAML
            object.__setattr__(self, "flex", FlexOptions(**self.flex))
        if not isinstance(self.max_chunked_experts, int) or self.max_chunked_experts < 0:
            raise ValueError(f"max_chunked_experts={self.max_chunked_experts!r} must be >= 0 (0 disables chunking)")
        if self.kind is not DispatcherKind.FLEX or self.flex.backend is not FlexBackend.DEEPEP_LEGACY:
            return
        if self.fp8:
            raise ValueError("FP8 dispatch (--moe-fp8-dispatch) runs with the alltoall and allgather dispatchers and "
                             "flex on DeepEP V2 (--moe-flex-dispatcher-backend deepep), not on deepep-legacy")
        if not self.flex.hybrid or self.flex.cpu_sync is False:
            raise ValueError("--moe-deepep-mode direct and sync-free dispatch (--no-moe-deepep-cpu-sync) are DeepEP "
                             "V2 settings (--moe-flex-dispatcher-backend deepep), not deepep-legacy's")

    def kind_for(self, ep: int, etp: int) -> DispatcherKind:
        """The dispatcher this config runs over ep x etp ranks (``kind_for_layout``)."""
        return kind_for_layout(self.kind, ep, etp)

    def check_layout(self, ep: int, etp: int) -> None:
        """ValueError naming the numbers when this dispatcher cannot run over ep x etp ranks."""
        if self.kind is DispatcherKind.LOCAL and ep * etp > 1:
            raise ValueError(f"dispatcher='local' needs ep*etp=1, got ep={ep} etp={etp}; use 'allgather' or "
                             "'alltoall'")


__all__ = ["AUTO", "DispatchConfig", "DispatcherKind", "FlexOptions", "kind_for_layout", "DEEPEP_MODES",
           "deepep_hybrid", "deepep_mode", "dispatcher_kind", "dispatcher_text"]
