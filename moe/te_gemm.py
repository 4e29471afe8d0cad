"""Transformer Engine's ``GroupedLinear`` as a persistent module over moefold's stacked expert weights.

``GroupedExperts`` keeps its weights as two stacked parameters (``w13 [e, G, F, H]``, ``w2 [e, H,
F]``) because checkpoints, resharding, HF import/export, initialisation and gradient reduction
all address them by those names and shard metadata. TE's ``GroupedLinear`` instead registers one
parameter per GEMM (``weight0 .. weight{e-1}``, each ``[out, in]``). ``TEGroupedLinear`` bridges
the two without copying:

- one ``te.GroupedLinear`` per projection is built once, on the meta device (it allocates no
  weights), and kept for the life of the experts: its FP8 state (scales, amax history) persists
  from step to step as TE intends;
- each call runs it with ``torch.func.functional_call``, substituting ``w[i]`` (views of the
  stacked parameter) for ``weight{i}``, so TE's weight gradients flow back into the stacked
  parameter's ``.grad`` through autograd and moefold's parameter names never change (no
  state-dict adapter is needed);
- ``m_splits`` is a host list, as TE's GroupedLinear requires;
- with FP8 (``precision.fp8.FP8Config``) the GEMMs run inside the TE autocast region the model entered
  for the whole stage forward (``precision.fp8_region``) and the rows are padded to FP8's per-group
  alignment (``TEExpertGemms``);
- a rank whose experts got no rows runs the same TE calls with zero rows (TE zeroes an empty GEMM's
  output, ``csrc/extensions/gemm.cpp``): every rank of the amax group must issue the same TE
  calls, or delayed scaling's amax reductions differ between them (``precision.fp8_region``).

Gradient accumulation: TE computes each weight gradient in the activation dtype and returns it;
autograd stacks them into ``w.grad`` and the trainer's hook adds that into the fp32
``param.main_grad`` (the same path as every other parameter). TE's own
``fuse_wgrad_accumulation=True`` (the wgrad GEMM accumulating straight into ``main_grad``) is
not used: TE would need a ``main_grad`` on each per-expert view plus Megatron's
``grad_added_to_main_grad`` protocol in the optimizer's hook (TE then returns a dummy gradient
that the hook must skip), which the stacked layout and moefold's optimizer do not implement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from moefold.dense.grad_accumulation import MainGradSlot
from moefold.dense.split_backward import WeightGradStore
from moefold.moe.expert_gemm import ExpertGemm, GemmBase, GemmCall, Projection
from moefold.moe.gemm import GemmBackend, import_backend
from moefold.precision.fp8 import FP8Config
from moefold.precision.fp8_region import require_region


class TEGroupedLinear:
    """``y[rows_i] = x[rows_i] @ w[i].T`` for ``w [e, M, K]`` through one persistent ``te.GroupedLinear``.

    Not an ``nn.Module`` on purpose: it owns no parameters (TE's are meta placeholders) and must
    stay out of ``named_parameters``/``state_dict``; the stacked weight is passed to each call.
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, dtype: torch.dtype | None = None) -> None:
        te = import_backend(GemmBackend.TE)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.module = te.GroupedLinear(num_gemms, in_features, out_features, bias=False,
                                       params_dtype=dtype or torch.get_default_dtype(), device="meta")

    def __call__(self, x_NK: Tensor, w_eMK: Tensor, m_splits: list[int]) -> Tensor:
        if tuple(w_eMK.shape) != (self.num_gemms, self.out_features, self.in_features):
            raise ValueError(f"TEGroupedLinear built for [{self.num_gemms}, {self.out_features}, "
                             f"{self.in_features}] weights, got {tuple(w_eMK.shape)}")
        # unbind: one view per expert whose backward stacks the e gradients once; w[i] would make e
        # SelectBackward nodes, each adding a zero-filled [e, M, K] tensor (moe.gemm's loop does the same)
        params: dict[str, Any] = dict(zip((f"weight{i}" for i in range(self.num_gemms)), w_eMK.unbind(0)))
        return torch.func.functional_call(self.module, params, (x_NK, m_splits))


@dataclass(frozen=True)
class TECall(GemmCall):
    """A TE call's row splits as its GEMMs take them: the host counts, FP8-padded (``te.Fp8Padding``) with FP8."""

    splits: list[int] = field(default_factory=list)


class TEExpertGemms(GemmBase[TECall]):
    """The experts' two projections through TE (``moe.expert_gemm.ExpertGemm``), with FP8 when ``fp8`` is enabled.

    ``fc1`` maps ``[*, H]`` rows through ``w13 [e, G*F, H]``, ``fc2`` ``[*, F]`` through ``w2 [e, H, F]``; ``N`` may
    be 0 (the same TE calls run). With FP8 the calls must be inside the model's TE autocast region
    (``precision.fp8_region``), and the rows are padded once, before the first GEMM, to the recipe's per-group
    alignment (``te.Fp8Padding``: zero rows, which stay zero through the bias-free MLP) and unpadded after the
    second. Kept out of ``torch.compile``'s graphs: TE's module forwards are dynamo-disabled anyway
    (``@no_torch_dynamo`` in ``module/grouped_linear.py``).
    """

    backend = GemmBackend.TE

    def __init__(self, num_gemms: int, hidden: int, gated_ffn: int, ffn: int, dtype: torch.dtype | None = None,
                 fp8: FP8Config | None = None) -> None:
        te = import_backend(GemmBackend.TE)
        self.fc1 = TEGroupedLinear(num_gemms, hidden, gated_ffn, dtype)
        self.fc2 = TEGroupedLinear(num_gemms, ffn, hidden, dtype)
        self.fp8 = fp8 if fp8 is not None and fp8.enabled else None
        self.pad = te.Fp8Padding(num_gemms) if self.fp8 else None
        self.unpad = te.Fp8Unpadding(num_gemms) if self.fp8 else None

    @torch.compiler.disable
    def enter(self, x_NH: Tensor, counts_e: Tensor, host: tuple[int, ...] | None, w13_eMK: Tensor,
              packed: bool) -> tuple[Tensor, TECall]:
        splits = [int(m) for m in host or ()]
        if self.pad is None:
            return x_NH, TECall(counts_e, host, splits)
        require_region(self.fp8, "TEExpertGemms")
        x_pad, padded = self.pad(x_NH, splits)
        return x_pad, TECall(counts_e, host, padded)

    @torch.compiler.disable
    def enter_probs(self, probs_N: Tensor | None, call: TECall) -> Tensor | None:
        # FP8: padded like the rows (zero probs on the padding rows), as Megatron's TEGroupedMLP pads
        # ``permuted_probs.unsqueeze(-1)`` with the same ``Fp8Padding``
        if probs_N is None or self.pad is None:
            return probs_N
        return self.pad(probs_N.unsqueeze(-1), [int(m) for m in call.host or ()])[0].squeeze(-1)

    @torch.compiler.disable
    def project(self, which: Projection, x: Tensor, w_eMK: Tensor, call: TECall, slot: MainGradSlot | None) -> Tensor:
        return (self.fc1 if which is Projection.FC1 else self.fc2)(x, w_eMK, call.splits)

    @torch.compiler.disable
    def leave(self, out: Tensor, call: TECall) -> Tensor:
        return out if self.unpad is None else self.unpad(out, [int(m) for m in call.host or ()])

    def with_weight_grad_store(self, store: WeightGradStore) -> ExpertGemm[GemmCall]:
        raise ValueError("split backward (zero-bubble schedules, --delay-wgrad-compute) cannot defer the weight "
                         "gradients of the 'te' expert GEMMs (Transformer Engine has its own delay_wgrad_compute); "
                         "use --moe-grouped-gemm-backend grouped_mm")


__all__ = ["TECall", "TEExpertGemms", "TEGroupedLinear"]
