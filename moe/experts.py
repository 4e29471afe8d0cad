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

SwiGLU is ``act(gate) * (up + glu_linear_offset)`` with ``act(g) = g * sigmoid(alpha * g)`` (alpha 1:
SiLU) and, with ``clamp``, gate clamped to ``<= clamp`` and up to ``[-clamp, clamp]`` first: GPT-OSS's
clamped SwiGLU (alpha 1.702, clamp 7, offset 1; Megatron's quick-GeGLU with
``--activation-func-clamp-value 7 --glu-linear-offset 1``). ``GatedActivation`` holds the three.

Sharding: the expert dim over ``ep`` (rank ``ep_rank`` holds experts ``[ep_rank*e, (ep_rank+1)*e)``),
the FFN dim ``F`` over ``etp`` (each etp rank holds a slice of every expert's hidden units, so its
output is a *partial sum* over etp that the dispatcher's combine reduces). Initialisation
(``parallel.sharding.init_parameters``) gives every row of the full ``[E, G, F, H]`` / ``[E, H, F]``
tensors its own seed and draws only this rank's, so the full weights are identical at every layout.
Expert parameters are flagged ``moefold_expert = True``: their gradients are reduced over the
expert-data-parallel group (edp), not dp.

GEMM backends (``moe.gemm``): every backend computes on these two stacked parameters. With
``te`` the experts own two persistent Transformer Engine ``GroupedLinear`` modules (built once,
no weights of their own: ``moe.te_gemm``) that run on views of ``w13``/``w2``, so parameter
names, checkpoints and HF import/export are the same for every backend. ``fp8`` (an enabled
``FP8Config``) runs the two GEMMs in FP8: under TE's autocast (``--fp8-backend te``, gemm backend
``te``), or through ``moe.fp8_gemm.Float8GroupedGemm`` (``--fp8-backend torchao``, gemm backend
``grouped_mm`` or ``loop``), chosen here once.

The default path (gemm backend ``grouped_mm``, no FP8) runs both projections through ``moe.expert_gemm``:
on CPU (``parallel.cpu_shortcuts``: the counts are read on the host, free there) the rows take a layout for
the GEMMs (``moe.expert_rows``: exact, aligned to 32 rows, or one ``bmm`` block per expert, by
``moe.expert_gemm.choose_layout``; ``row_layout`` fixes it), every large intermediate (projections,
SwiGLU output, their gradients) lives in the workspace pool (``parallel.workspace``) and SwiGLU is
``moe.swiglu`` (no ``cat``); with ``use_grad_accumulation_fusion`` the weight gradients go straight into the
main-grad buffer (``dense.grad_accumulation``). Elsewhere (CUDA) the same GEMMs are one
``torch.nn.functional.grouped_mm`` each from the device counts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.activation_offload import NO_OFFLOAD
from moefold.dense.grad_accumulation import grad_slot
from moefold.dense.recompute import CheckpointWithoutOutput
from moefold.dense.split_backward import WeightGradStore
from moefold.moe.block_gemm import BlockScaledGroupedGemm, check_expert_blocks
from moefold.moe.expert_gemm import choose_layout, grouped_linear
from moefold.moe.expert_rows import ROW_LAYOUTS, pad_rows, unpad_rows
from moefold.moe.fp8_gemm import Float8GroupedGemm, check_fp8_gemm_backend
from moefold.moe.gemm import (
    GEMM_BACKENDS,
    check_gemm_backend,
    flops_per_token,
    grouped_gemm,
    needs_host_counts,
    row_experts,
)
from moefold.moe.split_gemm import SplitGroupedGemm
from moefold.moe.swiglu import swiglu_rows
from moefold.parallel.comm import copy_to_region
from moefold.parallel.cpu_shortcuts import takes_cpu_shortcut
from moefold.parallel.groups import Group, group_rank, group_size
from moefold.parallel.sharding import Shard, mark_sharded, normal_init, set_init
from moefold.precision.fp8 import FP8Config
from moefold.precision.fp8_param import mark_fp8_param

if TYPE_CHECKING:
    from moefold.moe.te_gemm import TEExpertGemms

Activation = Literal["swiglu", "gelu"]
ACTIVATIONS: tuple[str, ...] = ("swiglu", "gelu")


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

    ``fp8_token_group``: with ``--fp8-backend torchao``, the ranks that hold these experts and split one
    micro-batch's tokens (``ParallelDims.expert_token_group``); FP8 scales over token rows reduce over it.
    ``glu``: the gated activation's parameters (None: SwiGLU); ``bias``: per-expert biases (GPT-OSS).
    ``row_layout``: the CPU row layout of the grouped GEMMs (``moe.expert_gemm.choose_layout``: auto, measured,
    packed, aligned, uniform).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 ep_group: Group = None, etp_group: Group = None, activation: str = "swiglu",
                 gemm_backend: str = "grouped_mm", init_std: float = 0.02, output_init_std: float | None = None,
                 fp8: FP8Config | None = None, fp8_token_group: Group = None, glu: GatedActivation | None = None,
                 bias: bool = False, row_layout: str = "auto", dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        ep, etp = group_size(ep_group), group_size(etp_group)
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupedExperts: {name}={value!r} must be a positive integer")
        if num_experts % ep:
            raise ValueError(f"GroupedExperts: num_experts={num_experts} is not divisible by ep={ep}")
        if ffn_hidden_size % etp:
            raise ValueError(f"GroupedExperts: ffn_hidden_size={ffn_hidden_size} is not divisible by etp={etp}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"GroupedExperts: activation={activation!r}; valid: {', '.join(ACTIVATIONS)}")
        if gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"GroupedExperts: gemm_backend={gemm_backend!r}; valid: {', '.join(GEMM_BACKENDS)}")
        if row_layout not in ROW_LAYOUTS:
            raise ValueError(f"GroupedExperts: row_layout={row_layout!r}; valid: {', '.join(ROW_LAYOUTS)}")
        check_gemm_backend(gemm_backend, dtype)
        if bias and gemm_backend == "te":
            raise ValueError("GroupedExperts: expert biases (GPT-OSS) are added between the GEMMs, which the 'te' "
                             "backend runs inside one call; use gemm backend 'grouped_mm', 'loop' or 'grouped_gemm'")
        if glu is not None and not glu.is_swiglu and activation != "swiglu":
            raise ValueError(f"GroupedExperts: glu={glu} parameterises the gated activation, not {activation!r}")
        fp8 = fp8 if fp8 is not None and fp8.enabled else None
        check_fp8_gemm_backend(fp8, gemm_backend)
        if fp8 is not None:
            fp8.check_available()
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.num_local_experts = num_experts // ep
        self.local_expert_offset = group_rank(ep_group) * self.num_local_experts
        self.activation, self.gemm_backend, self.row_layout = activation, gemm_backend, row_layout
        self.fuse_wgrad = False   # use_grad_accumulation_fusion
        self.gated = activation == "swiglu"  # decided once here, so forward does not compare strings
        self.glu = glu if glu is not None and not glu.is_swiglu else None
        self._eager_activation: Callable[[Tensor], Tensor] = (self.glu or swiglu) if self.gated else F.gelu
        self._activation = self._eager_activation
        self.ep_group, self.etp_group = ep_group, etp_group
        self.recompute_activation = False   # selective recompute ``moe_act`` (``dense.recompute``), set by the model
        # fine-grained activation offloading (``dense.activation_offload``) of the gate/up GEMM and the activation
        self.offload_expert_fc1 = self.offload_moe_act = NO_OFFLOAD
        e, f, gates = self.num_local_experts, ffn_hidden_size // etp, 2 if self.gated else 1
        kw = {"dtype": dtype, "device": device}
        self.w13 = nn.Parameter(torch.empty(e, gates, f, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, f, **kw))
        mark_sharded(self.w13, Shard.over(ep_group, 0), Shard.over(etp_group, 2))
        mark_sharded(self.w2, Shard.over(ep_group, 0), Shard.over(etp_group, 2))
        self.w13_bias = self.w2_bias = None
        if bias:   # zero-initialised (no init function), like every bias
            self.w13_bias = mark_expert(nn.Parameter(torch.zeros(e, gates, f, **kw)))
            self.w2_bias = mark_expert(nn.Parameter(torch.zeros(e, hidden_size, **kw)))
            mark_sharded(self.w13_bias, Shard.over(ep_group, 0), Shard.over(etp_group, 2))
            mark_sharded(self.w2_bias, Shard.over(ep_group, 0))
        self._adds_w2_bias = group_rank(etp_group) == 0   # the etp partial sums carry the bias once
        out_std = init_std if output_init_std is None else output_init_std
        for p, std in ((self.w13, init_std), (self.w2, out_std)):
            mark_expert(p)
            set_init(p, normal_init(std))
            with torch.no_grad():  # usable before init_parameters, which redraws layout-independently
                p.normal_(0.0, std)
        self.fp8 = fp8
        self._host_counts = needs_host_counts(gemm_backend)  # decided once
        # the two projections' GEMMs (grouped_gemm's signature), decided once
        self._gemm13: Callable[..., Tensor] = grouped_gemm
        self._gemm2: Callable[..., Tensor] = grouped_gemm
        if fp8 is not None and fp8.backend == "torchao":  # etp splits w13's rows (M) and w2's columns (K)
            grouped = gemm_backend == "grouped_mm"
            tokens = fp8_token_group  # ParallelDims.expert_token_group: see moe.fp8_gemm
            if fp8.block_scaled:   # blockwise / mxfp8 / nvfp4: moe.block_gemm
                check_expert_blocks(fp8, f, etp)
                gemm_cls = BlockScaledGroupedGemm
            else:
                gemm_cls = Float8GroupedGemm
            self._gemm13 = gemm_cls(fp8, grouped=grouped, m_group=etp_group, token_group=tokens)
            self._gemm2 = gemm_cls(fp8, grouped=grouped, k_group=etp_group, token_group=tokens)
            if fp8.param_gather:   # FP8 primary weights: one matrix per expert (precision.fp8_param)
                mark_fp8_param(self.w13, fp8, {"out_group": etp_group}, matrix=(gates * f, hidden_size))
                mark_fp8_param(self.w2, fp8, {"in_group": etp_group}, matrix=(hidden_size, f))
        # TE's modules hold per-module state (FP8 scales): built once, kept out of the module tree
        # (a tuple is not registered), so parameters and state_dict stay w13 / w2
        self._te: tuple[TEExpertGemms, ...] = ()
        if gemm_backend == "te":
            from moefold.moe.te_gemm import TEExpertGemms  # lazy: imports transformer_engine

            self._te = (TEExpertGemms(e, hidden_size, gates * f, f, dtype, fp8),)

    def _activate(self, h_NGf: Tensor) -> Tensor:
        """[N, G*f] input projections -> [N, f] hidden units (SwiGLU on gate/up halves, or GELU)."""
        if h_NGf.shape[0] < 2:  # torch.compile specialises sizes 0 and 1: no recompile for a rank without rows
            return self._eager_activation(h_NGf)
        return self._activation(h_NGf)

    def use_fused_activation(self, enabled: bool = True) -> None:
        """Run the activation as ``fused_activation``'s compiled kernels (what ``--compile`` does) or eagerly."""
        self._activation = fused_activation(self._eager_activation) if enabled else self._eager_activation

    @property
    def _default_gemms(self) -> bool:
        """The ``moe.expert_gemm`` path applies: grouped_mm backend, no FP8 / TE / other GEMM installed."""
        return self.gemm_backend == "grouped_mm" and self._gemm13 is grouped_gemm and self._gemm2 is grouped_gemm

    def use_grad_accumulation_fusion(self, enabled: bool = True) -> bool:
        """Weight gradients into the main-grad buffer (``dense.grad_accumulation``). False (nothing fuses) for
        the other GEMM backends and FP8, whose weight gradients come through autograd."""
        self.fuse_wgrad = enabled and self._default_gemms
        return self.fuse_wgrad

    def _add_w2_bias(self, out_NH: Tensor, rows_e: Tensor | None) -> Tensor:
        if self.w2_bias is None:
            return out_NH
        # every etp rank takes the bias through the region (its backward is a collective), rank 0 adds it
        b2_eH = _with_zero_row(copy_to_region(self.w2_bias, self.etp_group))
        return out_NH + (b2_eH[rows_e] if self._adds_w2_bias else 0.0 * b2_eH[rows_e])

    def use_weight_grad_store(self, store: WeightGradStore) -> None:
        """Split backward (``dense.split_backward``): defer both projections' weight gradients while ``store``
        defers (``moe.split_gemm``; torchao FP8 defers its own)."""
        if self._te:
            raise ValueError("split backward (zero-bubble schedules, --delay-wgrad-compute) cannot defer the weight "
                             "gradients of the 'te' expert GEMMs (Transformer Engine has its own "
                             "delay_wgrad_compute); use --moe-grouped-gemm-backend grouped_mm")
        for name in ("_gemm13", "_gemm2"):
            gemm = getattr(self, name)
            if isinstance(gemm, Float8GroupedGemm):
                gemm.use_weight_grad_store(store)
            else:
                setattr(self, name, SplitGroupedGemm(store))

    def forward(self, tokens_NH: Tensor, tokens_per_expert_e: Tensor,
                tokens_per_expert_host: Sequence[int] | None = None) -> Tensor:
        counts_host = tokens_per_expert_host
        if self._host_counts and counts_host is None:
            counts_host = tokens_per_expert_e.tolist()  # the backend takes host counts: one sync
        N = tokens_NH.shape[0]
        if counts_host is not None and sum(counts_host) != N:
            n = sum(int(c) for c in counts_host)
            if n > N:
                raise ValueError(f"GroupedExperts: the counts {list(counts_host)} cover {n} rows, there are {N}")
            # a sync-free dispatcher's worst-case rows past the last expert's (dispatch.base.Dispatched): skipped,
            # their outputs zero (never read)
            out = self._forward(tokens_NH[:n], tokens_per_expert_e, counts_host)
            return F.pad(out, (0, 0, 0, N - n))
        return self._forward(tokens_NH, tokens_per_expert_e, counts_host)

    def _forward(self, tokens_NH: Tensor, tokens_per_expert_e: Tensor, counts_host: Sequence[int] | None) -> Tensor:
        e, gates, f, H = self.w13.shape
        # [e, G, f, H] -> [e, G*f, H]: gate and up projections in a single grouped GEMM.
        w13 = self.w13.reshape(e, gates * f, H)
        if self._te:  # with no rows too: every rank of TE's amax group must run the same TE calls (moe.te_gemm)
            return self._te[0](tokens_NH, w13, self.w2, counts_host, self._activate)
        default, rows = self._default_gemms, None
        if default and takes_cpu_shortcut(tokens_NH):   # host counts cost nothing here (the GPU path never reads them)
            host = tuple(int(c) for c in (tokens_per_expert_e.tolist() if counts_host is None else counts_host))
            n = sum(host)
            if n < tokens_NH.shape[0]:   # a sync-free dispatcher's worst-case rows past the last block: zero outputs
                return F.pad(self._forward(tokens_NH[:n], tokens_per_expert_e, host), (0, 0, 0, tokens_NH.shape[0] - n))
            rows = choose_layout(host, tokens_NH, w13, "packed" if self.w13_bias is not None else self.row_layout)
        slots = (grad_slot(self.w13), grad_slot(self.w2)) if self.fuse_wgrad else (None, None)

        def gemm(i: int, x: Tensor, w: Tensor) -> Tensor:   # the ``moe.expert_gemm`` path or the backend's GEMM
            if default:
                return grouped_linear(x, w, tokens_per_expert_e, rows, slots[i])
            return (self._gemm13, self._gemm2)[i](x, w, tokens_per_expert_e, self.gemm_backend, trans_w=True,
                                                  counts_host=counts_host)

        with self.offload_expert_fc1:
            h_NGf = gemm(0, pad_rows(tokens_NH, rows) if rows is not None else tokens_NH, w13)
            rows_e = None
            if self.w13_bias is not None:   # packed rows (the bias forces them on CPU)
                # each row's expert, e for rows past the last block (no token: a zero bias, and their gradient goes
                # to that extra row, not to an expert's); output_size makes it sync-free on CUDA
                rows_e = row_experts(tokens_per_expert_e, tokens_NH.shape[0])
                h_NGf = h_NGf + _with_zero_row(self.w13_bias.reshape(e, gates * f))[rows_e]
        recompute = CheckpointWithoutOutput() if self.recompute_activation else None
        with self.offload_moe_act:
            if recompute is not None:   # the region must return a fresh tensor: autograd's activation
                act_Nf = recompute.checkpoint(self._activate, h_NGf)
            elif default and self.gated and self.glu is None and self._activation is self._eager_activation:
                act_Nf = swiglu_rows(h_NGf)   # SwiGLU without autograd's cat
            else:
                act_Nf = self._activate(h_NGf)
        out_NH = gemm(1, act_Nf, self.w2)
        if recompute is not None:   # moe_act: the activation is freed once w2 saved it, recomputed before its backward
            recompute.discard_output_and_register_recompute(out_NH)
        if rows is not None:
            out_NH = unpad_rows(out_NH, rows)
        return self._add_w2_bias(out_NH, rows_e)

    def flops(self, num_rows: int) -> int:
        """Forward FLOPs of ``num_rows`` routed rows through this rank's shard."""
        _, _, f, H = self.w13.shape
        return num_rows * flops_per_token(H, f, self.gated)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (local {self.num_local_experts} from {self.local_expert_offset}), "
                f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size} (etp {group_size(self.etp_group)}), "
                f"activation={self.activation}{f' {self.glu}' if self.glu else ''}, bias={self.w13_bias is not None}, "
                f"gemm={self.gemm_backend}, rows={self.row_layout}"
                + (f", {self.fp8.describe()}" if self.fp8 is not None else ""))


def _with_zero_row(t: Tensor) -> Tensor:
    """``t [e, ...]`` with a zero row ``e`` appended (the bias of rows past the last expert's block)."""
    return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])


def default_output_init_std(init_std: float, num_layers: int) -> float:
    """Megatron's scaled init for output projections: ``std / sqrt(2 * num_layers)``."""
    return init_std / math.sqrt(2.0 * num_layers)
