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

The activation is SwiGLU or GELU (``moe.activation``: ``GatedActivation`` shapes the gated one, GPT-OSS's clamped
SwiGLU among them).

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.activation_offload import NO_OFFLOAD
from moefold.dense.grad_accumulation import grad_slot
from moefold.dense.recompute import CheckpointWithoutOutput
from moefold.dense.split_backward import WeightGradStore
from moefold.moe.activation import eager_activation, fused_activation
from moefold.moe.config import ExpertsConfig
from moefold.moe.expert_gemm import ExpertGemm, GemmCall, Projection
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


class GroupedExperts(nn.Module):
    """The ``e = num_experts / ep`` local experts of one MoE layer.

    forward(tokens_NH, tokens_per_expert_e, tokens_per_expert_host=None) -> out_NH: rows
    expert-major (the first ``tokens_per_expert_e[0]`` rows go to local expert 0, ...),
    ``out = FFN_i(tokens)``, a partial sum over etp (no communication here: the dispatcher
    reduces it in combine and applies the routing probs there). ``tokens_per_expert_host``: the
    counts as host ints when the dispatcher has them; backends that need host counts (``te``,
    ``grouped_gemm``, ``loop``) otherwise read them from the device (one host synchronisation).

    ``config``: ``ExpertsConfig``; ``gemm``: the backend that runs the two projections (``moe.expert_gemm``;
    ``moe.build.build_experts`` builds both from the config).
    """

    def __init__(self, num_experts: int, hidden_size: int, config: ExpertsConfig, gemm: ExpertGemm[GemmCall], *,
                 ep_group: Group = None, etp_group: Group = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        e, f = self.local_shape(num_experts, hidden_size, config.ffn_hidden_size, group_size(ep_group),
                                group_size(etp_group))
        if gemm.backend is not config.gemm_backend:
            raise ValueError(f"GroupedExperts: the gemm backend object runs '{gemm.backend}', the config asks for "
                             f"'{config.gemm_backend}'")
        self.config, self.gemm = config, gemm
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, config.ffn_hidden_size
        self.num_local_experts = e
        self.local_expert_offset = group_rank(ep_group) * e
        self.fuse_wgrad = False   # use_grad_accumulation_fusion
        self.gated = config.activation.gates == 2
        self._eager_activation: Callable[[Tensor], Tensor] = eager_activation(config.activation, config.glu)
        self._fused = False
        self._activation = gemm.activation(self._eager_activation)   # outside recompute: the backend's
        self.ep_group, self.etp_group = ep_group, etp_group
        self.recompute_activation = False   # selective recompute ``moe_act`` (``dense.recompute``), set by the model
        # fine-grained activation offloading (``dense.activation_offload``) of the gate/up GEMM and the activation
        self.offload_expert_fc1 = self.offload_moe_act = NO_OFFLOAD
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

    def _activate(self, h_NGf: Tensor) -> Tensor:
        """[N, G*f] input projections -> [N, f] hidden units through autograd (SwiGLU on gate/up halves, or GELU):
        the compiled kernels (``use_fused_activation``), or the eager form."""
        if not self._fused or h_NGf.shape[0] < 2:  # torch.compile specialises sizes 0 and 1: no recompile for them
            return self._eager_activation(h_NGf)
        return fused_activation(self._eager_activation)(h_NGf)

    def use_fused_activation(self, enabled: bool = True) -> None:
        """Run the activation as ``fused_activation``'s compiled kernels (what ``--compile`` does), or as the
        backend runs it."""
        self._fused = enabled
        self._activation = self._activate if enabled else self.gemm.activation(self._eager_activation)

    def use_grad_accumulation_fusion(self, enabled: bool = True) -> bool:
        """Weight gradients into the main-grad buffer (``dense.grad_accumulation``). False (nothing fuses) for
        the backends whose weight gradients come through autograd (every one but ``grouped_mm`` without FP8)."""
        self.fuse_wgrad = enabled and self.gemm.fuses_wgrad
        return self.fuse_wgrad

    def use_weight_grad_store(self, store: WeightGradStore) -> None:
        """Split backward (``dense.split_backward``): defer both projections' weight gradients while ``store``
        defers (``moe.split_gemm``; torchao FP8 defers its own; ``te`` refuses)."""
        self.gemm = self.gemm.with_weight_grad_store(store)
        self.use_fused_activation(self._fused)

    def _add_w2_bias(self, out_NH: Tensor, rows_e: Tensor | None) -> Tensor:
        if self.w2_bias is None:
            return out_NH
        # every etp rank takes the bias through the region (its backward is a collective), rank 0 adds it
        b2_eH = _with_zero_row(copy_to_region(self.w2_bias, self.etp_group))
        return out_NH + (b2_eH[rows_e] if self._adds_w2_bias else 0.0 * b2_eH[rows_e])

    def forward(self, tokens_NH: Tensor, tokens_per_expert_e: Tensor,
                tokens_per_expert_host: Sequence[int] | None = None) -> Tensor:
        host = self.gemm.host_counts(tokens_NH, tokens_per_expert_e, tokens_per_expert_host)
        N = tokens_NH.shape[0]
        if host is not None and sum(host) != N:
            n = sum(host)
            if n > N:
                raise ValueError(f"GroupedExperts: the counts {list(host)} cover {n} rows, there are {N}")
            # a sync-free dispatcher's worst-case rows past the last expert's (dispatch.base.Dispatched): skipped,
            # their outputs zero (never read)
            out = self._forward(tokens_NH[:n], tokens_per_expert_e, host)
            return F.pad(out, (0, 0, 0, N - n))
        return self._forward(tokens_NH, tokens_per_expert_e, host)

    def _forward(self, tokens_NH: Tensor, tokens_per_expert_e: Tensor, host: tuple[int, ...] | None) -> Tensor:
        e, gates, f, H = self.w13.shape
        # [e, G, f, H] -> [e, G*f, H]: gate and up projections in a single grouped GEMM.
        w13 = self.w13.reshape(e, gates * f, H)
        gemm = self.gemm
        slots = (grad_slot(self.w13), grad_slot(self.w2)) if self.fuse_wgrad else (None, None)
        with self.offload_expert_fc1:
            x_in, call = gemm.enter(tokens_NH, tokens_per_expert_e, host, w13, self.w13_bias is not None)
            h_NGf = gemm.project(Projection.FC1, x_in, w13, call, slots[0])
            rows_e = None
            if self.w13_bias is not None:   # packed rows (enter keeps them so)
                # each row's expert, e for rows past the last block (no token: a zero bias, and their gradient goes
                # to that extra row, not to an expert's); output_size makes it sync-free on CUDA
                rows_e = row_experts(tokens_per_expert_e, tokens_NH.shape[0])
                h_NGf = h_NGf + _with_zero_row(self.w13_bias.reshape(e, gates * f))[rows_e]
        recompute = CheckpointWithoutOutput() if self.recompute_activation else None
        with self.offload_moe_act:
            # under recompute the region must return a fresh tensor: autograd's activation
            act_Nf = self._activation(h_NGf) if recompute is None else recompute.checkpoint(self._activate, h_NGf)
        out_NH = gemm.project(Projection.FC2, act_Nf, self.w2, call, slots[1])
        if recompute is not None:   # moe_act: the activation is freed once w2 saved it, recomputed before its backward
            recompute.discard_output_and_register_recompute(out_NH)
        return self._add_w2_bias(gemm.leave(out_NH, call), rows_e)

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
