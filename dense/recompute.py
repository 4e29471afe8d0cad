"""Activation recomputation: Megatron's choices and the two checkpoint mechanisms.

The mechanisms stay here, below the layers: a layer's own ``recompute`` argument checkpoints through them
(``dense.regions.CHECKPOINT``). Which region of which layer a choice recomputes (the MoE layer's and the routed
experts' included) is installed by the execution pass (``moefold.execution.recompute``).

Granularity (``--recompute-granularity``):

- ``none``: keep every activation.
- ``selective``: recompute the modules named by ``--recompute-modules`` (any subset of
  ``RECOMPUTE_MODULES``; Megatron's names and default ``core_attn``):

  ============== ===================================================== ====================
  module          what is recomputed in backward                         mechanism
  ============== ===================================================== ====================
  core_attn       softmax(q k^T) v (the S x S part); Gated DeltaNet:      ``checkpointed``
                  its delta rule (the chunk products and states)
  mlp             the dense MLP of a dense layer                          ``checkpointed``
  moe             the whole MoE layer (router, dispatch, experts, shared) ``checkpointed``
  shared_experts  the shared experts of an MoE layer                      ``checkpointed``
  moe_act         the routed experts' activation (and prob scaling)       output discarded
  layernorm       the block's input and post-attention RMSNorms           output discarded
  mla_up_proj     MLA's q/kv up-projections and RoPE                      output discarded
  ============== ===================================================== ====================

  ``moe`` includes ``moe_act`` and ``shared_experts`` (they are then not checkpointed twice).
- ``full``: recompute whole transformer blocks (``--recompute-method``/``--recompute-num-layers``:
  ``uniform`` checkpoints groups of N consecutive layers as one unit, ``block`` checkpoints the first
  N layers of each pipeline chunk one by one and keeps the others).

``checkpointed`` is ``torch.utils.checkpoint`` non-reentrant: it keeps the region's inputs, restores
the RNG state and supports nested outputs (the MoE layer's losses). ``CheckpointWithoutOutput``
(Megatron's output-discarding checkpoint) also frees the region's *output* once its consumer has
saved it, and refills that storage just before the consumer's backward, so a norm whose output feeds
a linear layer keeps only its input. Nothing crosses ranks here; a recomputed region replays its
collectives in backward, in the same order on every rank. With ``--fp8-backend te`` both mechanisms
replay the region inside the TE autocast region its forward ran in (``precision.fp8_region``): the
recomputed GEMMs run in FP8 with the same recipe and amax group, as TE's own ``checkpoint`` does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# the choices' names and checks live in dense.choices (torch-free, for the CLI); importable from here as before
from moefold.dense.choices import DEFAULT_RECOMPUTE_MODULES as DEFAULT_RECOMPUTE_MODULES
from moefold.dense.choices import RECOMPUTE_METHODS as RECOMPUTE_METHODS
from moefold.dense.choices import RECOMPUTE_MODES as RECOMPUTE_MODES
from moefold.dense.choices import RECOMPUTE_MODULES as RECOMPUTE_MODULES
from moefold.dense.choices import Recompute, check_recompute_modules
from moefold.dense.choices import check_recompute as check_recompute
from moefold.precision.fp8_region import Replay, active_region, recompute_context


def recomputed_modules(granularity: str, modules: Sequence[str]) -> frozenset[str]:
    """The modules that selective recompute checkpoints on their own: none unless ``granularity`` is
    "selective"; ``moe`` absorbs ``moe_act`` and ``shared_experts`` (one checkpoint around all of it)."""
    if granularity != Recompute.SELECTIVE:
        return frozenset()
    chosen = set(check_recompute_modules(modules))
    if "moe" in chosen:
        chosen -= {"moe_act", "shared_experts"}
    return frozenset(chosen)


def checkpointed(fn: Callable[..., Any], *args: Any, enabled: bool = True, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its activations recomputed in backward when ``enabled`` and grad is on."""
    if not enabled or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if active_region() is None or torch.compiler.is_compiling():
        # no TE region to replay; and inside a compiled graph no TE call can be (TE's calls break the graph, and
        # the frame around them runs eagerly, through the branch below), while torch.compile accepts only
        # dispatch-mode contexts from a context_fn
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=recompute_context, **kwargs)


class _NoGradRun(torch.autograd.Function):
    """Runs the region without recording it; backward replays it with grad and backpropagates through it."""

    @staticmethod
    def forward(ctx, owner: CheckpointWithoutOutput, *args: Any) -> Tensor | tuple[Tensor, ...]:
        with torch.no_grad():
            outputs = owner.fn(*args)
        ctx.owner = owner
        ctx.constants = [None if isinstance(a, Tensor) else a for a in args]   # non-tensor arguments
        ctx.save_for_backward(*(a for a in args if isinstance(a, Tensor)))
        owner.ctx = weakref.ref(ctx)   # the graph owns ctx; a strong reference back would be a cycle
        return outputs

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        owner = ctx.owner
        if owner.recomputed is None:   # the consumer kept no hook (e.g. its output needed no grad)
            owner.recompute()
        inputs, outputs = owner.recomputed
        owner.recomputed, owner.outputs = None, ()
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in inputs))


class CheckpointWithoutOutput:
    """Megatron's output-discarding checkpoint, for one call of one region::

        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(norm, x)        # runs norm without keeping its internals
        z = linear(y)                       # the consumer saves y ...
        ckpt.discard_output_and_register_recompute(z)   # ... whose storage is freed now and refilled,
                                                        # by recomputing norm(x), when z's gradient arrives

    The region must be deterministic (it draws no random numbers: norms, activations, projections) and
    return fresh tensors (not views of its inputs). Parameters used inside receive their gradients when
    the region is backpropagated.
    """

    def __init__(self) -> None:
        self.fn: Callable[..., Any] | None = None
        self.ctx: Callable[[], Any] | None = None   # weak reference to the autograd node
        self.outputs: tuple[Tensor, ...] = ()
        self.recomputed: tuple[tuple[Any, ...], tuple[Tensor, ...]] | None = None
        self.replay: Replay | None = None   # the TE FP8 region to recompute in (precision.fp8_region)

    def checkpoint(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args)
        self.fn = fn
        if active_region() is None:
            out = _NoGradRun.apply(self, *args)
        else:
            with Replay() as self.replay:
                out = _NoGradRun.apply(self, *args)
        self.outputs = out if isinstance(out, tuple) else (out,)
        return out

    def discard_output_and_register_recompute(self, hook_tensor: Tensor) -> None:
        """Free the outputs' storage (their consumers hold them only for backward) and recompute them when
        ``hook_tensor``'s gradient is computed, i.e. just before the consumers' backward."""
        if self.ctx is None or not hook_tensor.requires_grad:   # nothing will run the consumers' backward
            return
        for out in self.outputs:
            out.untyped_storage().resize_(0)
        hook_tensor.register_hook(lambda _grad: self._refill())

    def recompute(self) -> None:
        """Replay the region with grad on; keeps (inputs, outputs) for its backward."""
        ctx = self.ctx()
        saved = iter(x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors)
        inputs = tuple(next(saved) if c is None else c for c in ctx.constants)
        with torch.enable_grad(), (nullcontext() if self.replay is None else self.replay.recompute()):
            out = self.fn(*inputs)
        self.recomputed = (inputs, out if isinstance(out, tuple) else (out,))

    def _refill(self) -> None:
        self.recompute()
        for out, new in zip(self.outputs, self.recomputed[1]):
            storage = out.untyped_storage()
            storage.resize_(new.untyped_storage().nbytes())
            with torch.no_grad():
                storage.copy_(new.untyped_storage())
