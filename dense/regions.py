"""Regions: the named places in a layer's forward where a cross-cutting feature may run a part of it.

A layer does not know about recompute or activation offloading; it runs each of its named parts *through a
region* and lets ``moefold.execution`` (which sits above every layer) install the regions that do more. Two
kinds, both typed ``Protocol``s:

- ``Region``: ``region(fn, *args, **kwargs)`` runs ``fn(*args, **kwargs)`` and returns its result. The default
  ``PLAIN`` just calls it; ``CHECKPOINT`` runs it under ``dense.recompute.checkpointed`` (its activations
  recomputed in backward). ``execution`` adds the offload region (its saved tensors wait in host memory) and
  an offload region around a checkpoint.
- ``OutputRegion``: for a part whose *output* may be dropped once its consumer saved it (a norm feeding a
  linear, MLA's up-projections feeding core attention). ``opened = region.open()`` once per call, then
  ``y = opened.run(fn, *args)`` and, after the consumer ran, ``opened.consumed(consumer_output)``. The default
  ``KEEP_OUTPUT`` runs ``fn`` and keeps everything; ``execution`` adds the output-discarding checkpoint
  (``dense.recompute.CheckpointWithoutOutput``) and the offload region.

A layer keeps its regions in one frozen dataclass (``layer.regions``) and installs new ones only through its own
``configure(...)``, which checks each name and kind with ``replace_regions``. Nothing else sets them.

The regions a layer owns (names follow Megatron's ``--recompute-modules`` / ``--offload-modules``):

============================ ===================================================================
layer                        regions
============================ ===================================================================
``TransformerBlock``         ``body`` (the whole block), ``attn_norm``/``mlp_norm`` (output), ``ffn``
``GQAAttention``             ``qkv_linear``, ``core_attn``, ``attn_proj``
``MLAttention``              those three and ``up_proj`` (output)
``GatedDeltaNet``            ``core_attn`` (the delta rule)
``MoELayer``                 ``shared_experts``; ``routing`` (a ``moe.routing_replay.RoutingTap``: routing replay)
``GroupedExperts``           ``expert_fc1`` (the gate/up GEMM), ``moe_act`` (output: the activation, which the
                             down GEMM consumes)
``MoEDecoder``               ``layers``: how a chunk of layers runs (``models.decoder.LayerRun``)
============================ ===================================================================

The linears' second extension point is their GEMM: ``ColumnParallelLinear.configure(gemm=...)`` takes any
callable with ``F.linear``'s signature (``dense.linear.LocalGemm``). The routed experts' are three strategy objects
(``GroupedExperts.configure``: ``gemm``, an ``moe.expert_gemm.ExpertGemm``; ``weight_grads``, a
``moe.expert_gemm.WeightGrads``; ``activation_kernel``, a ``moe.activation.ActivationKernel``). Nothing here crosses
ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch import Tensor

from moefold.dense.recompute import checkpointed


@runtime_checkable
class Region(Protocol):
    """Runs one part of a forward: ``region(fn, *args, **kwargs) == fn(*args, **kwargs)`` in value."""

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class OpenedOutput(Protocol):
    """One call of an ``OutputRegion``: ``run`` the part, then tell it the consumer's output (``consumed``)."""

    def run(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def consumed(self, consumer_output: Tensor) -> None: ...


@runtime_checkable
class OutputRegion(Protocol):
    """A part whose output its consumer saves: ``open()`` once per call (module docstring)."""

    def open(self) -> OpenedOutput: ...


class _Kept:
    """An opened ``KEEP_OUTPUT``: the part runs as written, its output stays."""

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def consumed(self, consumer_output: Tensor) -> None:
        return None


_KEPT = _Kept()


class Plain:
    """The default of every region: runs the part as written."""

    recomputes = False

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def open(self) -> OpenedOutput:
        return _KEPT

    def __repr__(self) -> str:
        return "PLAIN"


class Checkpoint:
    """``checkpointed(fn, ...)``: the part's activations are recomputed in backward (``dense.recompute``). Built in
    here because the layers' own ``recompute`` arguments ask for it (a block built with ``recompute="full"``)."""

    recomputes = True

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpointed(fn, *args, **kwargs)

    def __repr__(self) -> str:
        return "CHECKPOINT"


PLAIN = Plain()
KEEP_OUTPUT = PLAIN   # as an OutputRegion: run the part, keep its output
CHECKPOINT = Checkpoint()
# a regions dataclass field holding an OutputRegion: ``field(default=KEEP_OUTPUT, metadata=OUTPUT_KIND)``
OUTPUT_KIND = {"kind": OutputRegion}


def recomputes(region: object) -> bool:
    """Whether ``region`` recomputes its part in backward (for descriptions and the overlap's checks)."""
    return bool(getattr(region, "recomputes", False))


R = TypeVar("R")


def replace_regions(current: R, owner: str, **changes: Any) -> R:
    """``current`` (a layer's frozen regions dataclass) with ``changes``; ValueError naming an unknown region or one
    of the wrong kind (a ``Region`` where an ``OutputRegion`` goes, or the reverse). A field's kind is the protocol
    in its metadata (``kind``), ``Region`` by default."""
    fields = {f.name: f for f in dataclasses.fields(current)}
    for name, region in changes.items():
        if name not in fields:
            raise ValueError(f"{owner}.configure: {name!r} is not one of its regions ({', '.join(fields)})")
        want = fields[name].metadata.get("kind", Region)
        if not isinstance(region, want):
            raise ValueError(f"{owner}.configure: {name}={region!r} is not a {want.__name__}")
    return dataclasses.replace(current, **changes)


__all__ = ["CHECKPOINT", "KEEP_OUTPUT", "OUTPUT_KIND", "PLAIN", "Checkpoint", "OpenedOutput", "OutputRegion", "Plain",
           "Region", "recomputes", "replace_regions"]
