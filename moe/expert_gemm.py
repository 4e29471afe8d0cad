"""The routed experts' GEMM backends: one protocol, ``ExpertGemm``, and the backends that need nothing but torch.

``GroupedExperts`` (``moe.experts``) runs every backend the same way, per call::

    host = gemm.host_counts(x, counts_e, counts_host)        # the counts as host ints, where the backend reads them
    x_in, call = gemm.enter(x, counts_e, host, w13, packed)  # the rows as the GEMMs take them, the call's counts
    p_in = gemm.enter_probs(probs, call)                     # each row's routing prob, laid out as the rows
    h = gemm.project(Projection.FC1, x_in, w13, call, slot)  # gate/up (or the one input) projection
    act = gemm.activation(eager)(h, p_in)                    # the backend's weighted activation (moe.activation)
    y = gemm.project(Projection.FC2, act, w2, call, slot)    # down projection
    out = gemm.leave(y, call)                                # back in the dispatcher's row order

``w`` is in the experts' ``[e, out, in]`` layout; rows are expert-major (``moe.gemm``). The backends:

- ``GroupedMMGemm``: ``torch.nn.functional.grouped_mm`` from the device counts, no host sync, weight gradients
  into main-grad with gradient-accumulation fusion (``moe.grouped_linear``); SwiGLU without autograd's ``cat``
  (``moe.swiglu``). On a CPU its subclass ``moe.cpu.backend.CpuRowsGemm`` lays the rows out for the CPU's GEMMs.
- ``HostCountsGemm``: ``loop`` (one ``mm`` per expert, the reference) and ``grouped_gemm`` (``grouped_gemm.ops.gmm``),
  host counts (``moe.gemm.grouped_gemm``).
- ``SplitGemm``: any of those with a deferrable weight gradient (split backward, ``moe.split_gemm``).
- ``Fp8Gemm``: torchao's FP8 (``moe.fp8_gemm.Float8GroupedGemm``) or block-scaled (``moe.block_gemm``) GEMMs.
- ``moe.te_gemm.TEExpertGemms``: Transformer Engine's ``GroupedLinear``, FP8 under TE's autocast.

``build_expert_gemm`` (``moe.build``) picks one from ``ExpertsConfig``; ``with_weight_grad_store`` gives a
backend's split-backward form (a new object, which the execution pass installs: ``GroupedExperts.configure``).
Where the weight gradients go is the experts' ``weight_grads`` strategy (``WeightGrads``: autograd, or the
main-grad slots for a backend that ``fuses_wgrad``). Nothing here crosses ranks (FP8 scales reduce over the groups
they hold).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Generic, Protocol, TypeVar

from torch import Tensor

from moefold.dense.grad_accumulation import MainGradSlot, grad_slot
from moefold.dense.split_backward import WeightGradStore
from moefold.moe.activation import Weighted, WeightedActivation, swiglu
from moefold.moe.block_gemm import BlockScaledGroupedGemm
from moefold.moe.fp8_gemm import Float8GroupedGemm
from moefold.moe.gemm import GemmBackend, grouped_gemm
from moefold.moe.grouped_linear import grouped_linear
from moefold.moe.split_gemm import SplitGroupedGemm
from moefold.moe.swiglu import swiglu_rows


class Projection(IntEnum):
    """The experts' two projections: ``FC1`` (``w13``: gate and up, or the one input projection), ``FC2`` (``w2``)."""

    FC1 = 0
    FC2 = 1


class WeightGrads(Enum):
    """Where the experts' GEMMs put their weight gradients: ``AUTOGRAD`` returns them (autograd accumulates ``.grad``);
    ``MAIN_GRAD`` writes them into each weight's main-grad slot where the trainer gave it one (gradient-accumulation
    fusion, ``dense.grad_accumulation``; only a backend that ``fuses_wgrad`` takes it)."""

    AUTOGRAD = "autograd"
    MAIN_GRAD = "main_grad"

    def slot(self, weight: Tensor) -> MainGradSlot | None:
        """The slot ``project`` gets for ``weight`` (the parameter itself: a reshaped view has no slot)."""
        return grad_slot(weight) if self is WeightGrads.MAIN_GRAD else None


@dataclass(frozen=True)
class GemmCall:
    """One experts call's counts as the GEMMs take them: ``counts_e`` [e] on the device, ``host`` the same as host
    ints (None where the backend does not read them). Backends add what else the call needs."""

    counts_e: Tensor
    host: tuple[int, ...] | None


CallT = TypeVar("CallT", bound=GemmCall)


class ExpertGemm(Protocol[CallT]):
    """A backend of the experts' two projections (module docstring).

    backend:           the ``--moe-grouped-gemm-backend`` it runs
    needs_host_counts: it reads the counts on the host (the experts read them once, one sync, when the dispatcher
                       did not bring them)
    fuses_wgrad:       it can write weight gradients into main-grad (``WeightGrads.MAIN_GRAD``)
    """

    backend: GemmBackend
    needs_host_counts: bool
    fuses_wgrad: bool

    def host_counts(self, x_NH: Tensor, counts_e: Tensor, counts_host: Sequence[int] | None,
                    ) -> tuple[int, ...] | None:
        """The call's counts as host ints: ``counts_host`` (the dispatcher's), else read where the backend needs
        them; None where it does not."""
        ...

    def enter(self, x_NH: Tensor, counts_e: Tensor, host: tuple[int, ...] | None, w13_eMK: Tensor,
              packed: bool) -> tuple[Tensor, CallT]:
        """The rows as the GEMMs take them and the call's counts. ``packed``: keep one row per token copy (the
        experts' biases are added per row)."""
        ...

    def project(self, which: Projection, x: Tensor, w_eMK: Tensor, call: CallT, slot: MainGradSlot | None) -> Tensor:
        """``x[rows_i] @ w[i]^T`` for every local expert i; ``slot``: ``w``'s main-grad slot (fusion), or None."""
        ...

    def enter_probs(self, probs_N: Tensor | None, call: CallT) -> Tensor | None:
        """Each row's routing prob (``[N]`` fp32, or None) laid out as ``enter`` laid out the rows (zero for the
        rows it added)."""
        ...

    def leave(self, out: Tensor, call: CallT) -> Tensor:
        """The second projection's output back in the rows ``enter`` was given."""
        ...

    def activation(self, eager: Weighted) -> WeightedActivation:
        """This backend's implementation of the weighted activation whose eager form is ``eager``."""
        ...

    def with_weight_grad_store(self, store: WeightGradStore) -> ExpertGemm[GemmCall]:
        """A new backend that runs this one's GEMMs with weight gradients ``store`` may defer (split backward);
        ValueError for a backend that cannot defer them."""
        ...


class GemmBase(Generic[CallT]):
    """What most backends share: host counts read when ``needs_host_counts``, rows entered and left as they are, the
    eager activation, and ``SplitGemm`` for split backward."""

    backend: GemmBackend
    needs_host_counts = True
    fuses_wgrad = False

    def host_counts(self, x_NH: Tensor, counts_e: Tensor, counts_host: Sequence[int] | None,
                    ) -> tuple[int, ...] | None:
        if counts_host is not None:
            return tuple(int(c) for c in counts_host)
        return tuple(counts_e.tolist()) if self.needs_host_counts else None   # one host sync

    def enter(self, x_NH: Tensor, counts_e: Tensor, host: tuple[int, ...] | None, w13_eMK: Tensor,
              packed: bool) -> tuple[Tensor, GemmCall]:
        return x_NH, GemmCall(counts_e, host)

    def enter_probs(self, probs_N: Tensor | None, call: CallT) -> Tensor | None:
        return probs_N

    def leave(self, out: Tensor, call: CallT) -> Tensor:
        return out

    def activation(self, eager: Weighted) -> WeightedActivation:
        return eager

    def with_weight_grad_store(self, store: WeightGradStore) -> ExpertGemm[GemmCall]:
        return SplitGemm(self.backend, store)


class GroupedMMGemm(GemmBase[GemmCall]):
    """``grouped_mm`` from the device counts (``moe.grouped_linear``): no host sync; SwiGLU as ``swiglu_rows``."""

    backend = GemmBackend.GROUPED_MM
    needs_host_counts = False
    fuses_wgrad = True

    def project(self, which: Projection, x: Tensor, w_eMK: Tensor, call: GemmCall,
                slot: MainGradSlot | None) -> Tensor:
        return grouped_linear(x, w_eMK, call.counts_e, slot)

    def activation(self, eager: Weighted) -> WeightedActivation:
        return swiglu_rows if eager.act is swiglu else eager


class HostCountsGemm(GemmBase[GemmCall]):
    """``loop`` or ``grouped_gemm`` (``moe.gemm.grouped_gemm``) on host counts."""

    def __init__(self, backend: GemmBackend) -> None:
        if backend not in (GemmBackend.LOOP, GemmBackend.GROUPED_GEMM):
            raise ValueError(f"HostCountsGemm runs gemm backends loop and grouped_gemm, not '{backend}'")
        self.backend = backend

    def project(self, which: Projection, x: Tensor, w_eMK: Tensor, call: GemmCall,
                slot: MainGradSlot | None) -> Tensor:
        return grouped_gemm(x, w_eMK, call.counts_e, self.backend, trans_w=True, counts_host=call.host)


class SplitGemm(GemmBase[GemmCall]):
    """``backend``'s GEMMs with a deferrable weight gradient (``moe.split_gemm.SplitGroupedGemm``)."""

    def __init__(self, backend: GemmBackend, store: WeightGradStore) -> None:
        self.backend, self.needs_host_counts = backend, backend.needs_host_counts
        self.gemm = SplitGroupedGemm(store)

    def project(self, which: Projection, x: Tensor, w_eMK: Tensor, call: GemmCall,
                slot: MainGradSlot | None) -> Tensor:
        return self.gemm(x, w_eMK, call.counts_e, self.backend, trans_w=True, counts_host=call.host)

    def with_weight_grad_store(self, store: WeightGradStore) -> ExpertGemm[GemmCall]:
        return SplitGemm(self.backend, store)


class Fp8Gemm(GemmBase[GemmCall]):
    """torchao FP8 (``Float8GroupedGemm``) or block-scaled (``BlockScaledGroupedGemm``) GEMMs, one object per
    projection (etp splits w13's rows and w2's columns: their scales reduce over different dims). ``backend``:
    the gemm backend they stand for (``grouped_mm``: torch's grouped FP8 kernel where it runs; ``loop``: per
    expert; it reads the host counts, as ``loop`` does)."""

    def __init__(self, backend: GemmBackend, fc1: Float8GroupedGemm | BlockScaledGroupedGemm,
                 fc2: Float8GroupedGemm | BlockScaledGroupedGemm) -> None:
        self.backend, self.needs_host_counts, self.gemms = backend, backend.needs_host_counts, (fc1, fc2)

    def project(self, which: Projection, x: Tensor, w_eMK: Tensor, call: GemmCall,
                slot: MainGradSlot | None) -> Tensor:
        return self.gemms[which](x, w_eMK, call.counts_e, trans_w=True, counts_host=call.host)

    def activation(self, eager: Weighted) -> WeightedActivation:
        # the down GEMM keeps SwiGLU's output (its input) itself (its quantised copy, or the output under moe_act
        # recompute): ``swiglu_rows`` keeps only the gate/up rows and the probs beside it, where autograd's SwiGLU
        # would also keep silu(gate) and the unweighted product (bit for bit the same values)
        return swiglu_rows if eager.act is swiglu else eager

    def saving_original_input(self, which: Projection) -> None:
        """The ``which`` GEMM keeps its high-precision input for backward instead of the quantised copy: where the
        input is kept anyway, or freed and refilled by an output-discarding recompute (``moe_act`` recompute: the
        down GEMM's input; Megatron's ``set_save_original_input(linear_fc2)``)."""
        self.gemms[which].save_original_input = True

    def with_weight_grad_store(self, store: WeightGradStore) -> ExpertGemm[GemmCall]:
        fc1, fc2 = self.gemms
        if isinstance(fc1, Float8GroupedGemm) and isinstance(fc2, Float8GroupedGemm):   # they defer their casts too
            return Fp8Gemm(self.backend, fc1.with_weight_grad_store(store), fc2.with_weight_grad_store(store))
        # the block-scaled GEMMs cannot defer theirs: split backward runs the gemm backend's plain GEMMs
        return SplitGemm(self.backend, store)


__all__ = ["ExpertGemm", "Fp8Gemm", "GemmBase", "GemmCall", "GroupedMMGemm", "HostCountsGemm", "Projection",
           "SplitGemm", "WeightGrads"]
