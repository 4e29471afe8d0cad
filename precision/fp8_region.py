"""Transformer Engine's FP8 autocast as moefold enters it: once per stage forward, on the stage's amax group.

With ``--fp8-backend te`` every TE module (``te.Linear`` in the linears, ``te.GroupedLinear`` in the
experts) runs inside one ``fp8_autocast(config, amax_group)`` region entered by the model around a whole
forward of this rank's stage (``MoEDecoder.forward`` / ``logits``, ``DecoderStage.forward_step``), as
Megatron-Core does for delayed scaling (``transformer_block.py``: one outer ``get_fp8_context`` around
the layers; ``fp8_utils.get_fp8_context``: ``amax_reduction_group =
get_amax_reduction_group(with_context_parallel=True)``, the dp x cp x tp ranks of the stage). Why not
per module call: with ``DelayedScaling`` (``reduce_amax=True`` by default) TE all-reduces every
registered module's amax over the region's group at the exit of each *outermost* autocast
(``quantization.py`` ``autocast_exit`` -> ``reduce_and_update_fp8_tensors``) and again in the backward
of the region's first TE module; a region per module call is a collective per module (over the world
when no group is given), whose sequence differs between pipeline stages (deadlock) and between ranks
whose experts got rows and ranks whose experts got none (hang). One region per stage forward, on the
stage's group, gives every rank of that group the same two reductions per micro-batch (one forward,
one backward), provided every rank runs the same TE calls: ``GroupedExperts`` runs TE's grouped GEMMs
with 0 rows too (TE zeroes an empty GEMM's output, ``csrc/extensions/gemm.cpp``).

Activation recomputation replays a region's TE calls in backward, outside the forward's autocast:
``Replay`` (used by ``dense.recompute``) captures the region active when the checkpointed forward ran and,
if TE GEMMs ran inside it, re-enters the same recipe and group around the recompute, as TE's own
``checkpoint`` does (``distributed.py``: ``autocast(enabled=ctx.fp8, recipe=ctx.fp8_recipe)`` around the
recompute). Each re-entry's exit is one more amax reduction in backward, the same on every rank.

The TE GEMM wrappers call ``require_region`` and fail loudly when they run outside a region (they would
otherwise run silently in high precision): a caller that runs layers on its own (a benchmark, a test)
enters ``fp8_autocast`` itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

from moefold.parallel.groups import Group
from moefold.precision.fp8 import FP8Backend, FP8Config, import_te


@dataclass(frozen=True)
class FP8Region:
    """An active TE autocast: the run's FP8 config and the group its amaxes reduce over (None: this rank)."""

    config: FP8Config
    amax_group: Group


_ACTIVE: list[FP8Region] = []  # the regions entered on this thread, innermost last (like torch.autocast's state)


def uses_te(config: FP8Config | None) -> bool:
    """FP8 GEMMs through Transformer Engine (``--fp8-backend te`` with a format)."""
    return config is not None and config.enabled and config.backend is FP8Backend.TE


def fp8_autocast(config: FP8Config | None, amax_group: Group = None) -> AbstractContextManager:
    """TE's ``autocast`` for ``config`` with ``amax_reduction_group=amax_group`` (a null context unless
    ``uses_te(config)``). Enter it once per stage forward (module docstring); nested entries of the same
    region are free (TE reduces only when the outermost one exits)."""
    if not uses_te(config):
        return nullcontext()
    return _region(FP8Region(config, amax_group))


@contextmanager
def _region(region: FP8Region) -> Iterator[None]:
    te = import_te("transformer_engine.pytorch")
    recipe = region.config.te_recipe()
    # Recent TE releases name it ``autocast(enabled, recipe, amax_reduction_group)``; 2.8 and older only have
    # ``fp8_autocast(enabled, fp8_recipe, fp8_group)`` (deprecated since)
    if hasattr(te, "autocast"):
        context = te.autocast(enabled=True, recipe=recipe, amax_reduction_group=region.amax_group)
    else:
        context = te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=region.amax_group)
    with context:
        _ACTIVE.append(region)
        try:
            yield
        finally:
            _ACTIVE.pop()


def active_region() -> FP8Region | None:
    """The innermost TE autocast region entered through ``fp8_autocast`` on this thread, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def require_region(config: FP8Config, what: str) -> None:
    """Raise RuntimeError unless a TE region for ``config`` is active (``what``: the module asking)."""
    region = active_region()
    if region is None:
        raise RuntimeError(f"{what}: --fp8-backend te GEMMs must run inside precision.fp8_region.fp8_autocast(config, "
                           f"amax_group) (the model enters it once per stage forward); called outside any")
    if region.config.format != config.format or region.config.recipe != config.recipe:
        raise RuntimeError(f"{what} is configured for fp8 {config.format} {config.recipe} but runs inside a region "
                           f"for fp8 {region.config.format} {region.config.recipe}")
    for replay in _WATCHING:
        replay.te_calls += 1


def reenter(region: FP8Region | None) -> AbstractContextManager:
    """A new TE autocast with ``region``'s recipe and amax group (a null context for None)."""
    return nullcontext() if region is None else fp8_autocast(region.config, region.amax_group)


_WATCHING: list[Replay] = []  # the checkpointed forwards running now, each counting the TE GEMMs run inside it


class Replay:
    """What a checkpointed region needs to replay its TE GEMMs: the region active when it ran forward, and
    whether any TE GEMM ran inside it. ``recompute()`` re-enters that region only then: every re-entry's exit
    is one more amax all-reduce (and amax-history update) in backward, useless around a region without TE
    GEMMs (core attention, norms, activations)."""

    def __init__(self) -> None:
        self.region = active_region()
        self.te_calls = 0

    def __enter__(self) -> Replay:   # around the checkpointed forward
        if self.region is not None:
            _WATCHING.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.region is not None:
            _WATCHING.remove(self)

    def recompute(self) -> AbstractContextManager:
        """The context for the recompute: the forward's TE region if it ran TE GEMMs, else nothing."""
        return reenter(self.region) if self.te_calls else nullcontext()


class _ReplayRecompute(AbstractContextManager):
    """``Replay.recompute()`` decided when the recompute starts (after the forward counted its TE calls)."""

    def __init__(self, replay: Replay) -> None:
        self.replay, self.context = replay, nullcontext()

    def __enter__(self) -> None:
        self.context = self.replay.recompute()
        self.context.__enter__()

    def __exit__(self, *exc: object) -> bool | None:
        return self.context.__exit__(*exc)


def recompute_context() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn``: (forward context, recompute context), called when the
    checkpointed region runs forward (``Replay``)."""
    replay = Replay()
    return replay, _ReplayRecompute(replay)


__all__ = ["FP8Region", "Replay", "active_region", "fp8_autocast", "recompute_context", "reenter", "require_region",
           "uses_te"]
