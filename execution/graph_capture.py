"""The capture mechanics every CUDA-graph scope shares: flattened calls, their check, and the static-buffer run.

A scope is one call ``fn(*args, **kwargs)`` that a graph replays: a graph replays kernels on fixed addresses, so
each call must take tensors of the same shapes, dtypes and devices, and the same *host* values (ints, flags,
shapes read from the data). ``flatten_call`` splits a call (or a result) into its tensors and a ``CallSpec``: its
structure and every non-tensor value (tuples, lists, dicts and dataclasses are walked; anything else is a
constant compared by ``==``). Two calls fit one graph exactly when their specs are equal and their tensors'
metadata (``TensorMeta``) are: a host value that changes from call to call (a split size read from the device, a
count) makes the spec differ, which ``CallSpec.mismatch`` names.

``StaticRun`` is the capture-equivalent path of one scope, on any device: an autograd function that copies the
call's tensors into the scope's static input buffers, runs ``fn`` eagerly on them, copies the results into static
output buffers, and in backward copies the incoming gradients into static gradient buffers and backpropagates the
recorded forward into static input-gradient buffers, exactly the dataflow of ``torch.cuda.make_graphed_callables``'
forward and backward graphs (inputs and outputs at fixed addresses, the parameters' gradients returned to
autograd, outputs overwritten by the next call). On CUDA the captured graph replaces the eager run; on the CPU it
proves the scope's dataflow (``tests/execution/test_cuda_graph.py``). Nothing here crosses ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

_LEAF = "<tensor>"


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What a graph fixes about one tensor argument or result."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(t: Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _spec(obj: Any, leaves: list[Tensor]) -> Any:
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return _LEAF
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(_spec(o, leaves) for o in obj))
    if isinstance(obj, dict):
        return (dict, tuple(obj), tuple(_spec(v, leaves) for v in obj.values()))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        return (type(obj), names, tuple(_spec(getattr(obj, n), leaves) for n in names), "dataclass")
    return ("const", obj)


def _build(spec: Any, leaves: list[Tensor]) -> Any:
    """Inverse of ``_spec``: consumes ``leaves`` from the front."""
    if spec == _LEAF:
        return leaves.pop(0)
    if spec[0] == "const":
        return spec[1]
    if len(spec) == 4 and spec[3] == "dataclass":
        cls, names, parts, _ = spec
        obj = cls.__new__(cls)
        for name, part in zip(names, parts):
            object.__setattr__(obj, name, _build(part, leaves))
        return obj
    if spec[0] is dict:
        return {k: _build(p, leaves) for k, p in zip(spec[1], spec[2])}
    cls, parts = spec
    items = [_build(p, leaves) for p in parts]
    return cls._make(items) if hasattr(cls, "_make") else cls(items)


def structure(tree: Any) -> Any:
    if tree == _LEAF:
        return tree
    if tree[0] == "const":
        return ("const", type(tree[1]).__qualname__)
    if len(tree) == 4 and tree[3] == "dataclass":
        return (tree[0], tree[1], tuple(structure(p) for p in tree[2]))
    if tree[0] is dict:
        return (dict, tree[1], tuple(structure(p) for p in tree[2]))
    return (tree[0], tuple(structure(p) for p in tree[1]))


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """A flattened call or result: its structure with every host value, and its tensors' metadata."""

    tree: Any
    tensors: tuple[TensorMeta, ...]

    @property
    def key(self) -> Any:
        """What decides which graph a call replays: its structure and host values (a micro-batch's index in the
        global load state, None for the first one). Calls with one key must agree in every tensor's shape."""
        try:
            hash(self.tree)
            return self.tree
        except TypeError:   # an unhashable host value: the structure alone, the values then checked by mismatch
            return structure(self.tree)

    def rebuild(self, leaves: Sequence[Tensor]) -> Any:
        return _build(self.tree, list(leaves))

    def mismatch(self, other: CallSpec) -> str | None:
        """Why ``other`` cannot replay a graph captured for ``self`` (one phrase), or None."""
        if self.tree != other.tree:
            return "a host value (a count, a split size or a flag computed from the data) changed between calls"
        if len(self.tensors) != len(other.tensors):
            return f"{len(other.tensors)} tensors instead of {len(self.tensors)}"
        for i, (a, b) in enumerate(zip(self.tensors, other.tensors)):
            if a != b:
                return (f"tensor {i} is {list(b.shape)} {b.dtype} requires_grad={b.requires_grad}, captured as "
                        f"{list(a.shape)} {a.dtype} requires_grad={a.requires_grad} (a dynamic shape)")
        return None


def flatten_call(obj: Any) -> tuple[CallSpec, list[Tensor]]:
    """(spec, tensors) of any nest of tensors, sequences, dicts, dataclasses and constants."""
    leaves: list[Tensor] = []
    tree = _spec(obj, leaves)
    return CallSpec(tree, tuple(TensorMeta.of(t) for t in leaves)), leaves


def static_like(t: Tensor) -> Tensor:
    """A static buffer holding ``t``'s value: detached, and a leaf requiring grad where ``t`` does."""
    return t.detach().clone().requires_grad_(t.requires_grad)


class StaticState:
    """One scope's static buffers and its recorded forward (the CPU stand-in of the captured graphs)."""

    def __init__(self, fn: Callable[..., Any], params: Sequence[nn.Parameter], in_spec: CallSpec,
                 sample: Sequence[Tensor]) -> None:
        self.fn, self.params, self.in_spec = fn, tuple(p for p in params if p.requires_grad), in_spec
        self.inputs = [static_like(t) for t in sample]
        self.outputs: list[Tensor] | None = None
        self.out_spec: CallSpec | None = None
        self._graph_outputs: list[Tensor] = []
        self.grad_inputs: list[Tensor | None] | None = None

    def forward(self) -> list[Tensor]:
        """Run ``fn`` on the static inputs; its results land in the static outputs (same addresses every call)."""
        with torch.enable_grad():
            result = self.fn(*self.in_spec.rebuild(self.inputs[:]))
        spec, leaves = flatten_call(result)
        if self.outputs is None:
            self.out_spec, self.outputs = spec, [t.detach().clone() for t in leaves]
        else:
            why = self.out_spec.mismatch(spec)
            if why is not None:
                raise RuntimeError(f"CUDA graph scope: its results changed between calls: {why}")
            for buf, t in zip(self.outputs, leaves):
                buf.copy_(t.detach())
        self._graph_outputs = leaves
        return self.outputs

    def backward(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Backpropagate the recorded forward from ``grads`` into the static input and parameter gradients."""
        pairs = [(o, g) for o, g in zip(self._graph_outputs, grads) if o.requires_grad and g is not None]
        wrt = [t for t in self.inputs if t.requires_grad] + list(self.params)
        got = (torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
               if pairs and wrt else [None] * len(wrt))
        if self.grad_inputs is None:
            self.grad_inputs = [None if g is None else g.clone() for g in got]
        else:
            for i, g in enumerate(got):
                if g is None:
                    self.grad_inputs[i] = None
                elif self.grad_inputs[i] is None or self.grad_inputs[i].shape != g.shape:
                    self.grad_inputs[i] = g.clone()
                else:
                    self.grad_inputs[i].copy_(g)
        self._graph_outputs = []
        return self.grad_inputs


class StaticRun(torch.autograd.Function):
    """``StaticRun.apply(state, *inputs, *params)`` -> the static outputs (detached aliases, as the graphed callable
    returns them); backward returns the static gradients of the inputs that require grad and of the parameters."""

    @staticmethod
    def forward(ctx: Any, state: StaticState, *tensors: Tensor) -> tuple[Tensor, ...]:
        inputs = tensors[:len(state.inputs)]
        for buf, t in zip(state.inputs, inputs):
            buf.detach().copy_(t)
        outputs = state.forward()
        ctx.state = state
        ctx.needs = [t.requires_grad for t in inputs]
        returned = tuple(o.detach() for o in outputs)
        ctx.mark_non_differentiable(*[r for r, g in zip(returned, state._graph_outputs) if not g.requires_grad])
        return returned

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        state: StaticState = ctx.state
        got = iter(state.backward(grads))
        per_input = [next(got) if need else None for need in ctx.needs]
        per_param = list(got)
        return (None, *[None if g is None else g.detach() for g in per_input + per_param])


__all__ = ["CallSpec", "StaticRun", "StaticState", "TensorMeta", "flatten_call", "static_like", "structure"]
