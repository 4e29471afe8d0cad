"""This rank's routed experts as stacked weights, computed with one grouped GEMM per projection.

Weights (``nn.Linear`` ``[out, in]`` layout per expert, so HF checkpoints map without transposes):

- ``w13 [e, G, F/etp, H]``: the input projections. SwiGLU (``G = 2``): ``w13[:, 0]`` is the gate
  projection (Megatron/Mixtral ``w1``, HF ``gate_proj``) and ``w13[:, 1]`` the up projection
  (``w3``, HF ``up_proj``); HF's fused ``gate_up_proj [E, 2F, H]`` is ``w13.flatten(1, 2)``.
  GELU (``G = 1``): ``w13[:, 0]`` is the only input projection (HF ``fc1``/``w1``).
  Both halves live in one tensor so that one grouped GEMM computes them.
- ``w2 [e, H, F/etp]``: the down projection (``w2``, HF ``down_proj``).
- with ``bias`` (GPT-OSS): ``w13_bias [e, G, F/etp]`` and ``w2_bias [e, H]``, added to each row by its
  expert. ``w2_bias`` is replicated over etp and added on etp rank 0 only (the outputs are partial sums
  over etp); it enters through ``copy_to_region`` over etp, so its gradient is all-reduced there.

The activation is SwiGLU, GELU or squared ReLU (``moe.activation``: ``GatedActivation`` shapes the gated one, GPT-OSS's
clamped SwiGLU among them), weighted by each row's routing prob (``moe.activation.Weighted``): the experts return
``p * FFN(x)`` and the dispatcher's combine only sums a token's copies (Megatron-Core 0.16.1's order).

Sharding: the expert dim over ``ep`` (rank ``ep_rank`` holds experts ``[ep_rank*e, (ep_rank+1)*e)``),
the FFN dim ``F`` over ``etp`` (each etp rank holds a slice of every expert's hidden units, so its
output is a *partial sum* over etp that the dispatcher's combine reduces). Initialisation
(``parallel.sharding.init_parameters``) gives every row of the full ``[E, G, F, H]`` / ``[E, H, F]``
tensors its own seed and draws only this rank's, so the full weights are identical at every layout.
Expert parameters are flagged ``moefold_expert = True``: their gradients are reduced over the
expert-data-parallel group (edp), not dp.

GEMM backends: ``GroupedExperts`` is given one (``moe.expert_gemm.ExpertGemm``, built from ``ExpertsConfig`` by
``moe.build.build_experts``) and runs its two projections, its activation and its row layout through it the same
way for every backend (``moe.expert_gemm``'s docstring), on these two stacked parameters: parameter names,
checkpoints and HF import/export are the same for every backend (Transformer Engine's ``GroupedLinear`` runs on
views of them, ``moe.te_gemm``).

What the execution pass changes (``moefold.execution``), only through ``configure``: the regions (``ExpertsRegions``:
``expert_fc1`` around the gate/up GEMM, ``moe_act`` around the activation, whose output the down GEMM consumes) and
three strategies, each an object: ``gemm`` (the backend; its split-backward form, ``with_weight_grad_store``),
``weight_grads`` (``WeightGrads``: autograd or the main-grad slots) and ``activation_kernel``
(``moe.activation.ActivationKernel``: the backend's or the compiled one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.regions import KEEP_OUTPUT, OUTPUT_KIND, PLAIN, OutputRegion, Region, recomputes, replace_regions
from moefold.moe.activation import BACKEND_ACTIVATION, ActivationKernel, Weighted, eager_activation
from moefold.moe.config import ExpertsConfig
from moefold.moe.expert_gemm import ExpertGemm, GemmCall, Projection, WeightGrads
from moefold.moe.gemm import flops_per_token, row_experts
from moefold.parallel.comm import copy_to_region
from moefold.parallel.groups import Group, group_rank, group_size
from moefold.parallel.sharding import Shard, mark_sharded, normal_init, set_init
from moefold.precision.fp8_param import mark_fp8_param


def mark_expert(param: Tensor) -> Tensor:
    """Flag a parameter whose gradient is reduced over the expert-data-parallel group."""
    param.moefold_expert = True
    return param


def is_expert(param: Tensor) -> bool:
    return getattr(param, "moefold_expert", False)


@dataclass(frozen=True)
class ExpertsRegions:
    """Where the routed experts run their parts (``dense.regions``; Megatron's offload / recompute module names):
    ``expert_fc1`` the gate/up GEMM (its input rows are what it saves), ``moe_act`` the activation (an output region:
    its consumer is the down GEMM, so a recompute may free its output once that GEMM saved it)."""

    expert_fc1: Region = PLAIN
    moe_act: OutputRegion = field(default=KEEP_OUTPUT, metadata=OUTPUT_KIND)


class GroupedExperts(nn.Module):
    """The ``e = num_experts / ep`` local experts of one MoE layer.

    forward(tokens_NH, tokens_per_expert_e, tokens_per_expert_host=None, probs_N=None) -> out_NH: rows
    expert-major (the first ``tokens_per_expert_e[0]`` rows go to local expert 0, ...),
    ``out = p * FFN_i(tokens)`` with ``p = probs_N`` [N] fp32, each row's routing prob (``Dispatched.probs_N``),
    applied inside the activation (``w2``'s input is ``(act(h) * p).to(dtype)``, as Megatron-Core's experts; the
    ``w2`` bias weighted too), or plain ``FFN_i(tokens)`` without probs; a partial sum over etp (no communication
    here: the dispatcher's combine sums the copies and reduces over etp). ``tokens_per_expert_host``: the
    counts as host ints when the dispatcher has them; backends that need host counts (``te``,
    ``grouped_gemm``, ``loop``) otherwise read them from the device (one host synchronisation).

    ``config``: ``ExpertsConfig``; ``gemm``: the backend that runs the two projections (``moe.expert_gemm``;
    ``moe.build.build_experts`` builds both from the config). ``regions``, ``gemm``, ``weight_grads`` and
    ``activation_kernel`` change only through ``configure`` (module docstring).
    """

    def __init__(self, num_experts: int, hidden_size: int, config: ExpertsConfig, gemm: ExpertGemm[GemmCall], *,
                 ep_group: Group = None, etp_group: Group = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        e, f = self.local_shape(num_experts, hidden_size, config.ffn_hidden_size, group_size(ep_group),
                                group_size(etp_group))
        self.config = config
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, config.ffn_hidden_size
        self.num_local_experts = e
        self.local_expert_offset = group_rank(ep_group) * e
        self.gated = config.activation.gates == 2
        self._eager_activation: Weighted = eager_activation(config.activation, config.glu)
        self.regions = ExpertsRegions()
        self.gemm: ExpertGemm[GemmCall] = self._checked_gemm(gemm)
        self.weight_grads = WeightGrads.AUTOGRAD
        self.activation_kernel: ActivationKernel = BACKEND_ACTIVATION
        self._install_activation()
        self.ep_group, self.etp_group = ep_group, etp_group
        gates = config.activation.gates
        kw = {"dtype": dtype, "device": device}
        self.w13 = nn.Parameter(torch.empty(e, gates, f, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, f, **kw))
        mark_sharded(self.w13, Shard.over(ep_group, 0), Shard.over(etp_group, 2))
        mark_sharded(self.w2, Shard.over(ep_group, 0), Shard.over(etp_group, 2))
        self.w13_bias = self.w2_bias = None
        if config.bias:   # zero-initialised (no init function), like every bias
            self.w13_bias = mark_expert(nn.Parameter(torch.zeros(e, gates, f, **kw)))
            self.w2_bias = mark_expert(nn.Parameter(torch.zeros(e, hidden_size, **kw)))
            mark_sharded(self.w13_bias, Shard.over(ep_group, 0), Shard.over(etp_group, 2))
            mark_sharded(self.w2_bias, Shard.over(ep_group, 0))
        self._adds_w2_bias = group_rank(etp_group) == 0   # the etp partial sums carry the bias once
        std = config.init_std
        out_std = std if config.output_init_std is None else config.output_init_std
        for p, s in ((self.w13, std), (self.w2, out_std)):
            mark_expert(p)
            set_init(p, normal_init(s))
            with torch.no_grad():  # usable before init_parameters, which redraws layout-independently
                p.normal_(0.0, s)
        fp8 = config.fp8_gemms
        if fp8 is not None and fp8.param_gather:   # FP8 primary weights: one matrix per expert (precision.fp8_param)
            mark_fp8_param(self.w13, fp8, {"out_group": etp_group}, matrix=(gates * f, hidden_size))
            mark_fp8_param(self.w2, fp8, {"in_group": etp_group}, matrix=(hidden_size, f))

    @staticmethod
    def local_shape(num_experts: int, hidden_size: int, ffn_hidden_size: int, ep: int, etp: int) -> tuple[int, int]:
        """(local experts e, local FFN size f) over ep x etp ranks; ValueError naming the numbers when they do not
        divide."""
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupedExperts: {name}={value!r} must be a positive integer")
        if num_experts % ep:
            raise ValueError(f"GroupedExperts: num_experts={num_experts} is not divisible by ep={ep}")
        if ffn_hidden_size % etp:
            raise ValueError(f"GroupedExperts: ffn_hidden_size={ffn_hidden_size} is not divisible by etp={etp}")
        return num_experts // ep, ffn_hidden_size // etp

    @property
    def gemm_backend(self) -> str:
        return self.config.gemm_backend

    def configure(self, *, gemm: ExpertGemm[GemmCall] | None = None, weight_grads: WeightGrads | None = None,
                  activation_kernel: ActivationKernel | None = None, **regions: Region | OutputRegion) -> None:
        """Install regions by name (``ExpertsRegions``) and any of the three strategies: ``gemm`` (a backend of the
        config's ``gemm_backend``, e.g. its split-backward form), ``weight_grads`` (``WeightGrads.MAIN_GRAD`` needs a
        backend that ``fuses_wgrad``: ``grouped_mm`` without FP8), ``activation_kernel``. ValueError (one line) for an
        unknown region, a wrong kind, or a strategy of the wrong type or that the backend cannot run; nothing changes
        then."""
        new_regions = replace_regions(self.regions, "GroupedExperts", **regions)
        new_gemm = self.gemm if gemm is None else self._checked_gemm(gemm)
        grads = self.weight_grads if weight_grads is None else weight_grads
        if not isinstance(grads, WeightGrads):
            raise ValueError(f"GroupedExperts.configure: weight_grads={grads!r} is not a WeightGrads "
                             f"({', '.join(w.name for w in WeightGrads)})")
        if grads is WeightGrads.MAIN_GRAD and not new_gemm.fuses_wgrad:
            raise ValueError(f"GroupedExperts.configure: weight_grads=MAIN_GRAD (gradient-accumulation fusion) needs "
                             f"a gemm that fuses them (grouped_mm without FP8 or split backward), not "
                             f"{type(new_gemm).__name__} ({new_gemm.backend})")
        kernel = self.activation_kernel if activation_kernel is None else activation_kernel
        if not isinstance(kernel, ActivationKernel):
            raise ValueError(f"GroupedExperts.configure: activation_kernel={kernel!r} is not an ActivationKernel")
        self.regions, self.gemm, self.weight_grads, self.activation_kernel = new_regions, new_gemm, grads, kernel
        self._install_activation()

    def _checked_gemm(self, gemm: ExpertGemm[GemmCall]) -> ExpertGemm[GemmCall]:
        if getattr(gemm, "backend", None) is not self.config.gemm_backend:
            raise ValueError(f"GroupedExperts: the gemm backend object runs '{getattr(gemm, 'backend', None)}', the "
                             f"config asks for '{self.config.gemm_backend}'")
        return gemm

    def _install_activation(self) -> None:
        """The activation's two implementations from the strategy in force: ``_activation`` where its output stays,
        ``_recomputable_activation`` inside a region that frees and recomputes it (``ActivationKernel``)."""
        eager = self._eager_activation
        self._activation = self.activation_kernel.kept(eager, self.gemm.activation(eager))
        self._recomputable_activation = self.activation_kernel.recomputed(eager)

    def _add_w2_bias(self, out_NH: Tensor, rows_e: Tensor | None, probs_N: Tensor | None) -> Tensor:
        if self.w2_bias is None:
            return out_NH
        # every etp rank takes the bias through the region (its backward is a collective), rank 0 adds it
        b2_eH = _with_zero_row(copy_to_region(self.w2_bias, self.etp_group))
        b2_NH = b2_eH[rows_e] if self._adds_w2_bias else 0.0 * b2_eH[rows_e]
        if probs_N is None:
            return out_NH + b2_NH
        # the bias is part of the weighted output p * FFN(x): Megatron's ``_apply_bias`` ``(t + b * p).to(t.dtype)``
        return (out_NH + b2_NH * probs_N.unsqueeze(1)).to(out_NH.dtype)

    def forward(self, tokens_NH: Tensor, tokens_per_expert_e: Tensor,
                tokens_per_expert_host: Sequence[int] | None = None, probs_N: Tensor | None = None) -> Tensor:
        if probs_N is not None and tuple(probs_N.shape) != (tokens_NH.shape[0],):
            raise ValueError(f"GroupedExperts: probs of shape {tuple(probs_N.shape)} for {tokens_NH.shape[0]} rows")
        host = self.gemm.host_counts(tokens_NH, tokens_per_expert_e, tokens_per_expert_host)
        N = tokens_NH.shape[0]
        if host is not None and sum(host) != N:
            n = sum(host)
            if n > N:
                raise ValueError(f"GroupedExperts: the counts {list(host)} cover {n} rows, there are {N}")
            # a sync-free dispatcher's worst-case rows past the last expert's (dispatch.base.Dispatched): skipped,
            # their outputs zero (never read)
            out = self._forward(tokens_NH[:n], tokens_per_expert_e, host, None if probs_N is None else probs_N[:n])
            return F.pad(out, (0, 0, 0, N - n))
        return self._forward(tokens_NH, tokens_per_expert_e, host, probs_N)

    def _forward(self, tokens_NH: Tensor, tokens_per_expert_e: Tensor, host: tuple[int, ...] | None,
                 probs_N: Tensor | None) -> Tensor:
        e, gates, f, H = self.w13.shape
        # [e, G, f, H] -> [e, G*f, H]: gate and up projections in a single grouped GEMM.
        w13 = self.w13.reshape(e, gates * f, H)
        gemm = self.gemm
        call, h_NGf, rows_e = self.regions.expert_fc1(self._fc1, tokens_NH, tokens_per_expert_e, host, w13)
        act_region = self.regions.moe_act
        # a region that frees the activation's output and recomputes it (moe_act recompute) needs a fresh tensor,
        # not the backend's (which may write a reused workspace)
        activation = self._recomputable_activation if recomputes(act_region) else self._activation
        opened = act_region.open()
        # the routing probs weight each row here, inside the activation (moe.activation): (act(h) * p).to(dtype)
        p_in = gemm.enter_probs(probs_N, call)
        act_Nf = opened.run(activation, h_NGf) if p_in is None else opened.run(activation, h_NGf, p_in)
        out_NH = gemm.project(Projection.FC2, act_Nf, self.w2, call, self.weight_grads.slot(self.w2))
        opened.consumed(out_NH)   # the down GEMM has saved the activation
        return self._add_w2_bias(gemm.leave(out_NH, call), rows_e, probs_N)

    def _fc1(self, tokens_NH: Tensor, tokens_per_expert_e: Tensor, host: tuple[int, ...] | None, w13: Tensor,
             ) -> tuple[GemmCall, Tensor, Tensor | None]:
        """The ``expert_fc1`` part: the backend's call, the gate/up projections ``[N, G*f]`` (with their bias), each
        row's expert where the biases need it (else None)."""
        e, gates, f, _ = self.w13.shape
        gemm = self.gemm
        x_in, call = gemm.enter(tokens_NH, tokens_per_expert_e, host, w13, self.w13_bias is not None)
        h_NGf = gemm.project(Projection.FC1, x_in, w13, call, self.weight_grads.slot(self.w13))
        rows_e = None
        if self.w13_bias is not None:   # packed rows (enter keeps them so)
            # each row's expert, e for rows past the last block (no token: a zero bias, and their gradient goes
            # to that extra row, not to an expert's); output_size makes it sync-free on CUDA
            rows_e = row_experts(tokens_per_expert_e, tokens_NH.shape[0])
            h_NGf = h_NGf + _with_zero_row(self.w13_bias.reshape(e, gates * f))[rows_e]
        return call, h_NGf, rows_e

    def flops(self, num_rows: int) -> int:
        """Forward FLOPs of ``num_rows`` routed rows through this rank's shard."""
        _, _, f, H = self.w13.shape
        return num_rows * flops_per_token(H, f, self.gated)

    def extra_repr(self) -> str:
        c, fp8 = self.config, self.config.fp8_gemms
        glu = "" if c.glu.is_swiglu else f" {c.glu}"
        return (f"experts={self.num_experts} (local {self.num_local_experts} from {self.local_expert_offset}), "
                f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size} (etp {group_size(self.etp_group)}), "
                f"activation={c.activation}{glu}, bias={self.w13_bias is not None}, "
                f"gemm={c.gemm_backend}, rows={c.row_layout}" + (f", {fp8.describe()}" if fp8 is not None else ""))


def _with_zero_row(t: Tensor) -> Tensor:
    """``t [e, ...]`` with a zero row ``e`` appended (the bias of rows past the last expert's block)."""
    return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])


def default_output_init_std(init_std: float, num_layers: int) -> float:
    """Megatron's scaled init for output projections: ``std / sqrt(2 * num_layers)``."""
    return init_std / math.sqrt(2.0 * num_layers)
