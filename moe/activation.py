"""The routed experts' activation: ``ExpertActivation`` (which), ``GatedActivation`` (its gated form's parameters),
``Weighted`` (the activation times each row's routing prob, as the experts run it).

SwiGLU is ``act(gate) * (up + linear_offset)`` with ``act(g) = g * sigmoid(alpha * g)`` (alpha 1: SiLU) and, with
``clamp``, gate clamped to ``<= clamp`` and up to ``[-clamp, clamp]`` first: GPT-OSS's clamped SwiGLU (alpha 1.702,
clamp 7, offset 1; Megatron's quick-GeGLU with ``--activation-func-clamp-value 7 --glu-linear-offset 1``).
``GatedActivation`` holds the three; its defaults are plain SwiGLU (``swiglu``). Each expert GEMM backend runs one
implementation of it (``moe.expert_gemm.ExpertGemm.activation``); ``--compile`` fuses it (``fused_activation``).

The routing probs are applied here, inside the experts, as Megatron-Core 0.16.1 does (``experts.py``
``activation_func_with_probs``: ``(act(h) * probs).to(dtype)``, probs fp32 ``[N, 1]``): the down projection's input
is ``(act(h) * p).to(h.dtype)``, the product in fp32 rounded once, so the combine only sums a token's copies. Its
backward saves ``h`` and ``p`` only and recomputes ``act(h)`` for the probs' gradient ``sum_f d_out * act(h)``
(Megatron's fused ``weighted_swiglu`` / ``weighted_squared_relu`` save the same two); its values are autograd's of
the product formula (``Weighted``). ``p`` None: the probs were applied to the input (``--moe-apply-probs-on-input``),
the activation runs unweighted.

Which implementation the experts run is their ``activation_kernel`` strategy (``ActivationKernel``, installed by
``GroupedExperts.configure``): ``BACKEND_ACTIVATION`` (the default: the GEMM backend's) or ``COMPILED_ACTIVATION``
(``fused_activation``'s kernels: what ``--compile`` installs, ``execution.compile``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from moefold.moe.prob_rows import prob_grads, scale_rows_


class ExpertActivation(StrEnum):
    """The experts' activation: gated SiLU on the gate/up halves of one projection, or GELU or squared ReLU
    (Nemotron-H's ``relu2``) of one projection."""

    SWIGLU = "swiglu"
    GELU = "gelu"
    RELU2 = "relu2"

    @classmethod
    def _missing_(cls, value: object) -> ExpertActivation:
        raise ValueError(f"activation={value!r} is not one of {', '.join(cls)}")

    @property
    def gates(self) -> int:
        """Input projections computed by the first GEMM: gate and up (2), or one."""
        return 2 if self is ExpertActivation.SWIGLU else 1


def swiglu(h_NGf: Tensor) -> Tensor:
    """[N, 2f] gate and up projections (halves of one GEMM's output) -> [N, f] silu(gate) * up."""
    gate_Nf, up_Nf = h_NGf.chunk(2, dim=1)
    return F.silu(gate_Nf) * up_Nf


@dataclass(frozen=True)
class GatedActivation:
    """[N, 2f] gate and up halves -> [N, f] ``act(gate) * (up + linear_offset)``, ``act(g) = g * sigmoid(alpha * g)``,
    gate clamped to ``<= clamp`` and up to ``[-clamp, clamp]`` first when ``clamp`` is set (GPT-OSS: 1.702, 7, 1;
    HF ``GptOssExperts._apply_gate``). The defaults are plain SwiGLU (``swiglu``)."""

    alpha: float = 1.0
    clamp: float | None = None
    linear_offset: float = 0.0

    def __post_init__(self) -> None:
        if not self.alpha > 0 or (self.clamp is not None and not self.clamp > 0):
            raise ValueError(f"GatedActivation: alpha={self.alpha} and clamp={self.clamp} must be > 0 (clamp: or None)")

    @property
    def is_swiglu(self) -> bool:
        return self.alpha == 1.0 and self.clamp is None and self.linear_offset == 0.0

    def __call__(self, h_NGf: Tensor) -> Tensor:
        gate_Nf, up_Nf = h_NGf.chunk(2, dim=1)
        if self.clamp is not None:
            gate_Nf = gate_Nf.clamp(max=self.clamp)
            up_Nf = up_Nf.clamp(-self.clamp, self.clamp)
        act_Nf = F.silu(gate_Nf) if self.alpha == 1.0 else gate_Nf * torch.sigmoid(gate_Nf * self.alpha)
        return act_Nf * (up_Nf + self.linear_offset) if self.linear_offset else act_Nf * up_Nf


def relu2(h_Nf: Tensor) -> Tensor:
    """Squared ReLU, ``relu(h)^2`` (Nemotron-H's ``relu2``, Megatron's ``squared_relu``)."""
    return torch.square(F.relu(h_Nf))


def base_activation(activation: ExpertActivation, glu: GatedActivation) -> Activation:
    """The activation without the probs: ``swiglu`` (plain SwiGLU), ``glu`` (its other parameters), GELU or squared
    ReLU."""
    if activation is ExpertActivation.GELU:
        return F.gelu
    if activation is ExpertActivation.RELU2:
        return relu2
    return swiglu if glu.is_swiglu else glu


def eager_activation(activation: ExpertActivation, glu: GatedActivation) -> Weighted:
    """The weighted activation in its eager form (``Weighted`` of ``base_activation``)."""
    return Weighted(base_activation(activation, glu))


Activation = Callable[[Tensor], Tensor]


class WeightedActivation(Protocol):
    """``(h [N, G*f], probs_N [N] fp32 or None) -> [N, f]``: ``(act(h) * probs[:, None]).to(h.dtype)``, or ``act(h)``
    without probs (module docstring)."""

    def __call__(self, h_NGf: Tensor, probs_N: Tensor | None = None, /) -> Tensor: ...


class _WeightedActivation(torch.autograd.Function):
    """Forward: ``(act(h) * p[:, None]).to(h.dtype)``, saving only ``h`` and ``p``. Backward: ``act(h)`` recomputed
    (autograd, from the saved ``h``) for both gradients; the values are autograd's of the product formula: the
    output gradient widened to the product's dtype, ``d_act = (g * p)`` rounded to ``act``'s dtype, ``d_p =
    sum_f g * act`` in the product's dtype."""

    @staticmethod
    def forward(ctx, h_NGf: Tensor, probs_N: Tensor, act: Activation) -> Tensor:
        ctx.act = act
        ctx.save_for_backward(h_NGf, probs_N)
        return scale_rows_(act(h_NGf), probs_N)   # act's output is a new tensor: weighted in place

    @staticmethod
    def backward(ctx, grad: Tensor):
        h_NGf, probs_N = ctx.saved_tensors
        with torch.enable_grad():
            h = h_NGf.detach().requires_grad_(ctx.needs_input_grad[0])
            a_Nf = ctx.act(h)
        a = a_Nf.detach()
        d_a, grad_p = prob_grads(grad, probs_N, (lambda rows: a[rows]) if ctx.needs_input_grad[1] else None)
        grad_h = None
        if ctx.needs_input_grad[0]:
            (grad_h,) = torch.autograd.grad(a_Nf, h, d_a)
        return grad_h, grad_p, None


@dataclass(frozen=True)
class Weighted:
    """An activation ``act`` with the routing probs applied (``WeightedActivation``; module docstring): autograd's
    values, but only ``h`` and ``p`` saved (``act`` recomputed in backward)."""

    act: Activation

    def __call__(self, h_NGf: Tensor, probs_N: Tensor | None = None, /) -> Tensor:
        if probs_N is None:
            return self.act(h_NGf)
        return _WeightedActivation.apply(h_NGf, probs_N, self.act)


def weighted_product(act: Activation, h_NGf: Tensor, probs_N1: Tensor) -> Tensor:
    """The product formula ``(act(h) * p).to(h.dtype)`` (``probs_N1`` [N, 1]) as plain autograd ops: what
    ``fused_weighted_activation`` compiles and the tests compare against."""
    return (act(h_NGf) * probs_N1).to(h_NGf.dtype)


@functools.cache
def fused_activation(activation: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """The activation (``swiglu``, a ``GatedActivation`` or ``F.gelu``) as one ``torch.compile``d kernel forward
    and one backward (shared by every layer with the same activation).

    Eager SwiGLU runs silu and the product as separate passes over the strided halves of
    ``h`` (and four more in backward, plus the ``cat`` of the two gradient halves); inductor fuses
    each direction into one pass (C++ on CPU, Triton on CUDA). ``dynamic=True``: the row count N
    changes every step (routing), so it is a symbolic dimension, not a recompile.
    """
    return torch.compile(activation, dynamic=True)


@functools.cache
def fused_weighted_activation(activation: Activation) -> Callable[[Tensor, Tensor], Tensor]:
    """``weighted_product(activation, h, p [N, 1])`` as one ``torch.compile``d kernel per direction (as
    ``fused_activation``; inductor's partition saves ``h`` and ``p`` and recomputes the activation in backward)."""
    return torch.compile(functools.partial(weighted_product, activation), dynamic=True)


@runtime_checkable
class ActivationKernel(Protocol):
    """Which implementation of the weighted activation the experts run, from its eager form ``eager`` and the GEMM
    backend's own implementation ``backend`` (``ExpertGemm.activation``): ``kept`` where the activation's output
    stays, ``recomputed`` where a region frees and refills it (``moe_act`` recompute: the output must be a fresh
    tensor, never a reused workspace buffer such as ``moe.swiglu.swiglu_rows`` writes)."""

    def kept(self, eager: Weighted, backend: WeightedActivation) -> WeightedActivation: ...

    def recomputed(self, eager: Weighted) -> WeightedActivation: ...


class BackendActivation:
    """The GEMM backend's implementation (``grouped_mm``'s ``swiglu_rows``), the eager one under recompute."""

    def kept(self, eager: Weighted, backend: WeightedActivation) -> WeightedActivation:
        return backend

    def recomputed(self, eager: Weighted) -> WeightedActivation:
        return eager

    def __repr__(self) -> str:
        return "BACKEND_ACTIVATION"


@dataclass(frozen=True)
class _CompiledOrEager:
    """``fused_weighted_activation`` (``fused_activation`` without probs) of ``eager``'s activation for two rows or
    more, ``eager`` below (torch.compile specialises the sizes 0 and 1: running those eagerly spares their
    recompiles)."""

    eager: Weighted

    def __call__(self, h_NGf: Tensor, probs_N: Tensor | None = None, /) -> Tensor:
        if h_NGf.shape[0] < 2:
            return self.eager(h_NGf, probs_N)
        if probs_N is None:
            return fused_activation(self.eager.act)(h_NGf)
        return fused_weighted_activation(self.eager.act)(h_NGf, probs_N.unsqueeze(1))


class CompiledActivation:
    """``fused_activation``'s compiled kernels, one per direction (``--compile``), kept or recomputed alike."""

    def kept(self, eager: Weighted, backend: WeightedActivation) -> WeightedActivation:
        return _CompiledOrEager(eager)

    def recomputed(self, eager: Weighted) -> WeightedActivation:
        return _CompiledOrEager(eager)

    def __repr__(self) -> str:
        return "COMPILED_ACTIVATION"


BACKEND_ACTIVATION = BackendActivation()
COMPILED_ACTIVATION = CompiledActivation()

__all__ = ["BACKEND_ACTIVATION", "COMPILED_ACTIVATION", "Activation", "ActivationKernel", "BackendActivation",
           "CompiledActivation", "ExpertActivation", "GatedActivation", "Weighted", "WeightedActivation",
           "base_activation", "eager_activation", "fused_activation", "fused_weighted_activation", "swiglu",
           "weighted_product"]
