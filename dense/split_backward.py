"""Split backward: a GEMM's input gradient now, its weight gradient later.

For ``y = x W^T`` the backward computes ``dx = dy W`` (the layer below, and the previous pipeline
stage, wait for it) and ``dW = dy^T x`` (only the optimizer needs it). Zero-bubble schedules run the
first as ``I`` and the second as ``W`` to fill pipeline bubbles; ``--delay-wgrad-compute`` runs the
experts' ``dW`` while the dispatch's backward exchange is in flight (torch's
``pipelining._backward.stage_backward_input`` / ``stage_backward_weight`` split autograd graphs the
same way; here the GEMMs split themselves, so a recomputed region is not replayed for ``W`` and no
GEMM runs twice)::

    store = WeightGradStore()
    install_weight_grad_store(model, store)    # once, by moefold.execution (execution.split_backward)
    with store.splitting():                    # a forward whose backward will be split (the schedule knows)
        out = model(x)
    with store.defer() as later:               # I: every deferrable GEMM computes dx only ...
        torch.autograd.backward(out, grad)
    later.run()                                # W: ... and its dW here, accumulated as the plain backward does

A forward outside ``store.splitting()`` builds the plain graph (the weights are inputs of their GEMMs, autograd
accumulates their gradients), so its backward is the plain backward (each weight's gradient accumulated once per
micro-batch even where two GEMMs share it). A split forward's GEMMs take detached weights and hand their gradients
over themselves: inside ``store.defer()`` to the deferral, outside it at once (one engine call per GEMM). Both
forms are the same autograd function saving the same tensors, so a recomputed region (whose recompute runs under
whatever ``splitting`` state its backward sees) matches its forward. ``run()``
feeds each weight gradient to its parameter's ``AccumulateGrad`` node (``torch.autograd.backward`` on
its gradient edge), so accumulation into ``.grad`` / ``main_grad`` and post-accumulate hooks (the
gradient reduce-scatter's buckets) behave exactly as in the plain backward. Deferred gradients
accumulate in the order ``run()`` is called; schedules run the ``W`` of each micro-batch in the order
of their ``I``, so every parameter sums its micro-batches in the plain order.

This module is the part every splitting GEMM shares (the store, the deferral, ``weight_inputs`` and
``accumulate_or_defer`` that a GEMM's autograd function calls); it stays below the layers because the experts'
GEMMs (``moe.split_gemm``, ``moe.fp8_gemm``) use it. The linears' split GEMM and the walk that installs the store
are ``moefold.execution.split_backward``.

What defers: the column/row-parallel linears' local GEMM (``F.linear`` or torchao FP8) and the routed
experts' grouped GEMMs (``moe.split_gemm``, torchao FP8 ``moe.fp8_gemm``). Everything else (norm
weights, the router, embeddings, a tied output head, replicated k/v rows) computes its small weight
gradients inside ``I``. Transformer Engine GEMMs have their own ``delay_wgrad_compute`` and are refused
here. Memory: a deferred GEMM keeps its saved input and its output gradient until ``W``.
Nothing crosses ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

WeightGrads = Callable[[], Sequence[Tensor | None]]


def gradient_edges(*tensors: Tensor | None) -> tuple[GradientEdge | None, ...]:
    """Where each tensor's gradient enters autograd (its ``AccumulateGrad`` for a parameter, the view's node
    for a view of one); None for a tensor that needs no gradient. Taken in forward, used by a deferred W."""
    return tuple(get_gradient_edge(t) if t is not None and t.requires_grad else None for t in tensors)


class DeferredWeightGrads:
    """The weight-gradient GEMMs one backward left for later, in the order it met them."""

    def __init__(self) -> None:
        self._pending: list[tuple[tuple[GradientEdge | None, ...], WeightGrads]] = []

    def add(self, edges: Sequence[GradientEdge | None], compute: WeightGrads) -> None:
        self._pending.append((tuple(edges), compute))

    def __len__(self) -> int:
        return len(self._pending)

    def run(self) -> None:
        """Compute every deferred weight gradient and accumulate it into its parameter (once). A weight that several
        deferred GEMMs share (the output head with MTP) gets their gradients in one engine call, summed before they
        are accumulated, as the plain backward sums them; every other gradient is accumulated (and freed) as soon
        as it is computed."""
        pending, self._pending = self._pending, []
        uses: dict[tuple[int, int], int] = {}
        for edges, _ in pending:
            for e in edges:
                if e is not None:
                    uses[_key(e)] = uses.get(_key(e), 0) + 1
        held: dict[tuple[int, int], list[tuple[GradientEdge, Tensor]]] = {}
        for edges, compute in pending:
            now = []
            for e, g in zip(edges, compute()):
                if e is None or g is None:
                    continue
                if uses[_key(e)] == 1:
                    now.append((e, g))
                    continue
                held.setdefault(_key(e), []).append((e, g))
                if len(held[_key(e)]) == uses[_key(e)]:
                    now += held.pop(_key(e))
            _accumulate([e for e, _ in now], [g for _, g in now])
        for pairs in held.values():   # a shared weight some of whose GEMMs gave no gradient
            _accumulate([e for e, _ in pairs], [g for _, g in pairs])

    def merge_into(self, other: DeferredWeightGrads) -> None:
        """Hand every pending gradient to ``other`` (an enclosing deferral), keeping their order."""
        other._pending.extend(self._pending)
        self._pending = []


class WeightGradStore:
    """Where deferrable GEMMs leave their weight gradients while a backward runs under ``defer()``.

    One per model (installed on its GEMMs by ``install_weight_grad_store``); not global state. The
    flag is read inside backward, which on CUDA runs on autograd's device thread while the caller waits.
    """

    def __init__(self) -> None:
        self._open: list[DeferredWeightGrads] = []
        self._split: list[bool] = []

    @property
    def split(self) -> bool:
        """Whether the GEMMs of the forward running now build split graphs (``splitting``)."""
        return bool(self._split) and self._split[-1]

    @contextmanager
    def splitting(self, enabled: bool = True) -> Iterator[None]:
        """Forwards run inside build GEMMs whose weight gradients can be deferred (nestable; the innermost wins)."""
        self._split.append(enabled)
        try:
            yield
        finally:
            self._split.pop()

    @property
    def current(self) -> DeferredWeightGrads | None:
        """The innermost open deferral, or None (compute weight gradients at once)."""
        return self._open[-1] if self._open else None

    @contextmanager
    def defer(self) -> Iterator[DeferredWeightGrads]:
        """Backwards run inside leave their deferrable weight gradients in the yielded list (nestable)."""
        later = DeferredWeightGrads()
        self._open.append(later)
        try:
            yield later
        finally:
            self._open.pop()


@dataclass(frozen=True)
class SplitWeights:
    """A split GEMM's weights as its autograd function sees them: ``edges`` (``gradient_edges`` of the real
    weights) and ``anchor``, a 0-element leaf that requires grad, passed as one more input so that the
    function's output is on the graph (and its backward runs) even when its other inputs need no gradient."""

    edges: tuple[GradientEdge | None, ...]
    anchor: Tensor


def weight_inputs(store: WeightGradStore | None, *weights: Tensor | None,
                  ) -> tuple[tuple[Tensor | None, ...], SplitWeights | None]:
    """What a GEMM's autograd function takes as its weights: the weights themselves without a store or outside
    ``store.splitting()`` (autograd accumulates their gradients), else detached weights and their ``SplitWeights``:
    the function then hands its weight gradients to ``accumulate_or_defer`` (a weight that is a graph input would
    have its ``AccumulateGrad`` run, and its post-accumulate hooks fire, even for a gradient deferred as None)."""
    if store is None or not store.split:
        return weights, None
    device = next(w.device for w in weights if w is not None)
    split = SplitWeights(gradient_edges(*weights), torch.empty(0, device=device, requires_grad=True))
    return tuple(None if w is None else w.detach() for w in weights), split


def accumulate_or_defer(store: WeightGradStore, edges: Sequence[GradientEdge | None], compute: WeightGrads) -> None:
    """Inside a GEMM's backward: accumulate ``compute()`` (the gradients for ``edges``) now, or, while ``store``
    defers, at the deferral's ``run()``. ``compute`` must read only what it captured (saved tensors, the output
    gradient)."""
    later = store.current
    if later is None:
        _accumulate(edges, compute())
    else:
        later.add(edges, compute)


def _key(edge: GradientEdge) -> tuple[int, int]:
    return id(edge.node), edge.output_nr


def _accumulate(edges: Sequence[GradientEdge | None], grads: Sequence[Tensor | None]) -> None:
    pairs = [(e, g) for e, g in zip(edges, grads) if e is not None and g is not None]
    if pairs:
        torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])


__all__ = ["DeferredWeightGrads", "SplitWeights", "WeightGradStore", "accumulate_or_defer", "gradient_edges",
           "weight_inputs"]
