"""Gated DeltaNet linear attention (Qwen3-Next's ``linear_attention`` layers) with tensor and sequence parallelism.

HF ``Qwen3NextGatedDeltaNet`` semantics, per token::

    q, k, v, z = in_proj_qkvz(x)  (grouped by key head: [q_h, k_h, v_h, z_h] per key head h)
    b, a       = in_proj_ba(x)    (per key head: [b_h, a_h], r = value heads / key heads each)
    q, k, v    = silu(causal_depthwise_conv(q, k, v))      (kernel ``conv_kernel_size``, no bias; fp32, one
                                                           rounding: ``causal_conv_silu``)
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)          (fp32)
    o = gated_delta_rule(q, k, v, g, beta)                 (``dense.gated_delta_rule``)
    y = out_proj(rms_norm(o) * weight * silu(z))           (the gated RMSNorm over each value head)

Parameters (HF names under ``linear_attn.``; moefold keeps the block's ``self_attn`` slot):

- ``in_proj_qkvz [hk * (2dk + 2r dv), H]`` / ``in_proj_ba [hk * 2r, H]`` column-parallel: HF already lays them
  out per key head, so a tp shard holds ``hk/tp`` whole key heads with their r value heads.
- ``conv1d.weight [hk, 2dk + r dv, K]``: HF's ``[2 hk dk + hv dv, 1, K]`` has the channels in the order
  (all q, all k, all v), which no contiguous tp shard matches; moefold regroups them per key head (the
  order of ``in_proj_qkvz``'s output, so the convolution runs on it unpermuted) and the HF mapping permutes
  on import/export. Sharded along dim 0 (key heads).
- ``A_log [hv]``, ``dt_bias [hv]`` sharded along the value heads; ``norm.weight [dv]`` replicated (each rank
  uses it for its own heads, so it enters through ``copy_to_region``: complete gradients on every rank).
- ``out_proj`` row-parallel (reduce-scatter to the sequence shard under SP, else all-reduce).

Context parallelism (head-parallel, as Ulysses does for attention): the recurrence and the convolution need
every earlier token, so after the projections one all-to-all over cp trades the sequence for heads: each cp
rank then holds the whole sequence (in order) for ``1/cp`` of its key heads with their value heads, runs the
convolution and the delta rule on it unchanged, and a second all-to-all brings the outputs back to its own
tokens for every head. Needs ``num_key_heads / tp`` divisible by cp. The per-head parameters (conv, A_log,
dt_bias) get gradients only for the heads a cp rank ran; the dense gradient sum over cp completes them.

Packed documents (``documents`` with ``isolate``, ``dense.documents``): the convolution and the recurrence restart
at every document's first token: each document's tokens run through both on their own (zero convolution prefix,
zero initial state), exactly as the document alone would. Under CP the mixer holds the whole sample after the
first all-to-all, so the documents' global starts apply as they are.

Decoding: with ``cache`` set (``RecurrentCache``, what ``models.generate`` installs) a call continues the
sequence of the previous call: the convolution reads the cached last inputs and the delta rule starts from
the cached state; both are updated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.choices import DeltaRuleBackend, Recompute
from moefold.dense.cp_exchange import rank_order_to_global
from moefold.dense.documents import Documents
from moefold.dense.gated_delta_rule import (
    GATED_DELTA_RULE_BACKENDS,
    gated_delta_rule_impl,
    recurrent_gated_delta_rule,
    require_fla,
)
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear, on_tp_input
from moefold.dense.recompute import check_recompute
from moefold.dense.regions import CHECKPOINT, PLAIN, Region, recomputes, replace_regions
from moefold.parallel.comm import all_to_all, copy_to_region
from moefold.parallel.groups import Group, group_rank, group_size
from moefold.parallel.sharding import InitFn, Shard, mark_sharded, set_init


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GatedDeltaNetConfig.{name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Sizes of one Gated DeltaNet layer (HF ``linear_num_key_heads`` ... ``linear_conv_kernel_dim``).

    ``backend``: the delta-rule kernel (``dense.gated_delta_rule.GATED_DELTA_RULE_BACKENDS``): "torch" (the
    chunked form in plain torch), "fla" (flash-linear-attention's Triton kernel, CUDA; refused when not
    installed), "auto" (fla on CUDA tensors when installed, else torch). ``chunk_size``: the torch form's chunk.
    """

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64
    backend: str = "auto"
    recompute: str = "none"
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
                     "conv_kernel_size", "chunk_size"):
            _positive_int(name, getattr(self, name))
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"GatedDeltaNetConfig: num_value_heads={self.num_value_heads} is not a multiple of "
                             f"num_key_heads={self.num_key_heads}")
        if not self.norm_eps > 0:
            raise ValueError(f"GatedDeltaNetConfig.norm_eps={self.norm_eps!r} must be > 0")
        if self.backend not in GATED_DELTA_RULE_BACKENDS:
            raise ValueError(f"GatedDeltaNetConfig.backend={self.backend!r} is not one of {GATED_DELTA_RULE_BACKENDS}")
        object.__setattr__(self, "backend", DeltaRuleBackend(self.backend))
        if self.backend is DeltaRuleBackend.FLA:
            require_fla()
        object.__setattr__(self, "recompute", check_recompute(self.recompute, "GatedDeltaNetConfig.recompute"))
        if not self.init_std > 0:
            raise ValueError(f"GatedDeltaNetConfig.init_std={self.init_std!r} must be > 0")

    @property
    def value_heads_per_key_head(self) -> int:
        return self.num_value_heads // self.num_key_heads

    @property
    def conv_group_channels(self) -> int:
        """Convolved channels per key head: its q, k and r value heads."""
        return 2 * self.key_head_dim + self.value_heads_per_key_head * self.value_head_dim

    def check_parallel(self, tp: int, cp: int = 1) -> None:
        """Raise ValueError unless the key heads split over ``tp`` and then over ``cp`` (see the module docstring)."""
        if self.num_key_heads % tp:
            raise ValueError(f"GatedDeltaNetConfig: num_key_heads={self.num_key_heads} (linear attention key heads) "
                             f"is not divisible by tp={tp}")
        if (self.num_key_heads // tp) % cp:
            raise ValueError(f"Gated DeltaNet under context parallelism runs each cp rank on the whole sequence for "
                             f"1/cp of its heads: num_key_heads={self.num_key_heads} / tp={tp} is not divisible by "
                             f"cp={cp}")


def _uniform_init(low: float, high: float, transform=None) -> InitFn:
    def init(t: Tensor, gen: torch.Generator) -> None:
        t.uniform_(low, high, generator=gen)
        if transform is not None:
            t.copy_(transform(t))

    return init


def _inverse_softplus_dt(u: Tensor, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> Tensor:
    """Megatron's / Mamba's dt_bias init from u ~ U(0, 1): softplus(dt_bias) = dt, log-uniform in [dt_min, dt_max]."""
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


def heads_to_sequence(x: Tensor, cp_group: Group) -> Tensor:
    """``[S/cp, B, h, ...]`` (this rank's CP part, all its heads) -> ``[S, B, h/cp, ...]`` (the whole sequence in
    order, heads ``cp_rank * h/cp ..``). One all-to-all over cp; backward: the inverse exchange."""
    cp = group_size(cp_group)
    S, B, h, *rest = x.shape
    parts = x.reshape(S, B, cp, h // cp, *rest).movedim(2, 0).reshape(cp * S, B, h // cp, *rest)
    return rank_order_to_global(all_to_all(parts, [S] * cp, [S] * cp, cp_group), cp, 0)


def sequence_to_heads(x: Tensor, cp_group: Group) -> Tensor:
    """Inverse of ``heads_to_sequence``: ``[S, B, h/cp, ...]`` -> ``[S/cp, B, h, ...]``."""
    cp = group_size(cp_group)
    chunks = x.chunk(2 * cp, dim=0)   # sequence order -> each rank's (chunk r, chunk 2cp-1-r), in rank order
    parts = torch.cat([c for r in range(cp) for c in (chunks[r], chunks[2 * cp - 1 - r])], dim=0)
    S = x.shape[0] // cp
    received = all_to_all(parts, [S] * cp, [S] * cp, cp_group)
    return received.reshape(cp, S, *x.shape[1:]).movedim(0, 2).flatten(2, 3)


@dataclass
class RecurrentCache:
    """A Gated DeltaNet layer's decoding state: the last ``K - 1`` convolution inputs ``[B, C, K-1]`` and the
    delta-rule state ``[B, hv, dk, dv]`` (fp32). Empty before the prompt."""

    conv: Tensor | None = None
    state: Tensor | None = None


def _conv_silu_fp32(x_BCT: Tensor, weight_CK: Tensor) -> Tensor:
    """``causal_conv_silu``'s arithmetic: fp32 (fp64 inputs stay fp64)."""
    C, K = weight_CK.shape
    dtype = torch.promote_types(x_BCT.dtype, torch.float32)
    return F.silu(F.conv1d(x_BCT.to(dtype), weight_CK.to(dtype).view(C, 1, K), groups=C))


class _CausalConvSilu(torch.autograd.Function):
    """forward saves the inputs as they are (bf16 under --bf16) and backward recomputes the fp32 convolution from
    them, as causal_conv1d's backward kernel does: the island costs no fp32 activation memory."""

    @staticmethod
    def forward(ctx, x_BCT: Tensor, weight_CK: Tensor) -> Tensor:
        ctx.save_for_backward(x_BCT, weight_CK)
        return _conv_silu_fp32(x_BCT, weight_CK).to(x_BCT.dtype)

    @staticmethod
    def backward(ctx, grad_BCT: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            dtype = torch.promote_types(x.dtype, torch.float32)
            x32, w32 = (t.detach().to(dtype).requires_grad_() for t in (x, weight))
            dx, dw = torch.autograd.grad(_conv_silu_fp32(x32, w32), (x32, w32), grad_BCT.to(dtype))
        return (dx.to(x.dtype) if ctx.needs_input_grad[0] else None,
                dw.to(weight.dtype) if ctx.needs_input_grad[1] else None)


def causal_conv_silu(x_BCT: Tensor, weight_CK: Tensor) -> Tensor:
    """``silu(depthwise_conv(x))`` of the left-padded ``x [B, C, K - 1 + T]`` with ``weight [C, K]``: ``[B, C, T]``
    in x's dtype.

    An fp32 island: the products, their sum over the kernel and the silu in fp32, rounded once to x's dtype. That
    is what causal_conv1d's CUDA kernel computes, which Megatron-Core's ``GatedDeltaNet`` (outside its
    ``deterministic_mode``) and HF's Qwen3-Next call on GPUs where it is installed; HF's plain-torch fallback rounds
    the convolution, then the silu. On qwen3_next_tiny moefold's mean bf16 logit error is 0.89x HF's with the
    island, 0.97x without (benchmarks/RESULTS.md)."""
    return _CausalConvSilu.apply(x_BCT, weight_CK)


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over the sequence, no bias, then silu (fused, as causal_conv1d's kernel):
    ``y_t = silu(sum_j w[:, j] * x_{t-K+1+j})``, ``causal_conv_silu``'s fp32 island.

    ``weight [*channels, K]`` with the channels flattened in order (its dim 0 may be sharded). forward(x
    ``[S, B, C]``, prefix ``[B, C, K-1]`` | None = zeros) -> (y ``[S, B, C]`` in x's dtype, the last ``K-1``
    inputs).
    """

    def __init__(self, channels: tuple[int, ...], kernel_size: int, tp_group: Group = None, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        tp = group_size(tp_group)
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels[0] // tp, *channels[1:], kernel_size, dtype=dtype,
                                               device=device))
        mark_sharded(self.weight, Shard.over(tp_group, 0))
        bound = kernel_size ** -0.5   # nn.Conv1d's default (kaiming uniform, a=sqrt(5)) for one input channel
        set_init(self.weight, _uniform_init(-bound, bound))
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    def forward(self, x_SBC: Tensor, prefix: Tensor | None = None, rows: slice = slice(None),
                ) -> tuple[Tensor, Tensor]:
        """``rows``: the dim-0 rows of the (local) weight whose channels ``x`` holds."""
        C, K = x_SBC.shape[-1], self.kernel_size
        weight = self.weight[rows]
        x = x_SBC.permute(1, 2, 0).to(weight.dtype)
        x = F.pad(x, (K - 1, 0)) if prefix is None else torch.cat([prefix.to(x.dtype), x], dim=-1)
        y = causal_conv_silu(x, weight.reshape(C, K))
        return y.permute(2, 0, 1).to(x_SBC.dtype), x[..., x.shape[-1] - (K - 1):]


class GatedRMSNorm(nn.Module):
    """HF ``Qwen3NextRMSNormGated``: ``(weight * rms_norm(x)) * silu(z)``, computed in fp32 and rounded once
    (the fp32 island of ``dense.norm.rms_norm``; HF rounds the normalised value first, Megatron-Core's
    ``GatedDeltaNet._apply_gated_norm`` rounds after its norm and multiplies the gate in fp32; in fp32 all
    three are the same operations). forward(x ``[..., d]``, z ``[..., d]``, weight) -> ``[..., d]`` in x's dtype."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor, z: Tensor, weight: Tensor | None = None) -> Tensor:
        weight = self.weight if weight is None else weight
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((weight.to(torch.float32) * x32) * F.silu(z.float())).to(dtype)


@dataclass(frozen=True)
class DeltaNetRegions:
    """Where Gated DeltaNet runs its delta rule (``dense.regions``; Megatron's ``core_attn`` for this mixer)."""

    core_attn: Region = PLAIN


class GatedDeltaNet(nn.Module):
    """forward(x ``[S/tp, B, H]`` with SP else ``[S, B, H]``, position_ids ``[S]``, documents) -> same shape as x.

    ``S`` is this rank's sequence (its CP part). ``documents`` (or None): packed documents, each mixed on its own.
    Crosses ranks over tp (input all-gather / output reduce-scatter under SP, else the region all-reduces, like
    ``GQAAttention``) and cp (two all-to-alls, see the module docstring); ``position_ids`` are only checked (the
    recurrence is positional).
    """

    def __init__(self, config: GatedDeltaNetConfig, tp_group: Group = None, cp_group: Group = None, *,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        tp = group_size(tp_group)
        cp = group_size(cp_group)
        config.check_parallel(tp, cp)
        c = self.config = config
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.cp_group, self.cp, self.cp_rank = cp_group, cp, group_rank(cp_group)
        self.local_key_heads, self.local_value_heads = c.num_key_heads // tp, c.num_value_heads // tp
        r, dk, dv = c.value_heads_per_key_head, c.key_head_dim, c.value_head_dim
        kw = {"init_std": c.init_std, "dtype": dtype, "device": device}
        self.in_proj_qkvz = ColumnParallelLinear(c.hidden_size, c.num_key_heads * (2 * dk + 2 * r * dv), tp_group, **kw)
        self.in_proj_ba = ColumnParallelLinear(c.hidden_size, c.num_key_heads * 2 * r, tp_group, **kw)
        self.conv1d = CausalConv1d((c.num_key_heads, c.conv_group_channels), c.conv_kernel_size, tp_group,
                                   dtype=dtype, device=device)
        self.A_log = self._head_parameter(c.num_value_heads, tp_group, _uniform_init(1.0, 16.0, torch.log), dtype,
                                          device)
        self.dt_bias = self._head_parameter(c.num_value_heads, tp_group, _uniform_init(0.0, 1.0, _inverse_softplus_dt),
                                            dtype, device)
        self.norm = GatedRMSNorm(dv, c.norm_eps, dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(c.num_value_heads * dv, c.hidden_size, tp_group,
                                          sequence_parallel=sequence_parallel, **kw)
        # selective recompute of the delta rule by default (``config.recompute``); moefold.execution reconfigures it
        self.regions = DeltaNetRegions(core_attn=CHECKPOINT if c.recompute is Recompute.SELECTIVE else PLAIN)
        self.cache: RecurrentCache | None = None
        self._rules: dict[str, object] = {}

    def configure(self, **regions: Region) -> None:
        """Install regions by name (``DeltaNetRegions``); ValueError for an unknown name or a wrong kind."""
        self.regions = replace_regions(self.regions, "GatedDeltaNet", **regions)

    @staticmethod
    def _head_parameter(heads: int, tp_group: Group, init: InitFn, dtype, device) -> nn.Parameter:
        p = nn.Parameter(torch.empty(heads // group_size(tp_group), dtype=dtype, device=device))
        mark_sharded(p, Shard.over(tp_group, 0))
        set_init(p, init)
        with torch.no_grad():   # usable before init_parameters (which redraws it layout-independently)
            init(p, None)
        return p

    def _rule(self, device_type: str):
        if device_type not in self._rules:   # the kernel is chosen once per device type, not per call
            self._rules[device_type] = gated_delta_rule_impl(self.config.backend, device_type, self.config.chunk_size)
        return self._rules[device_type]

    def _core(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              documents: Documents | None = None) -> Tensor:
        """The delta rule on ``[B, S, heads, d]`` inputs (with the decoding cache when one is set); with
        ``documents``, on each document alone (a zero initial state at every document's start)."""
        cache = self.cache
        if documents is not None:
            return self._core_documents(q, k, v, g, beta, documents)
        if cache is None:
            return self._rule(q.device.type)(q, k, v, g, beta)[0]
        rule = recurrent_gated_delta_rule if q.shape[1] == 1 else self._rule(q.device.type)
        o, cache.state = rule(q, k, v, g, beta, initial_state=cache.state, output_final_state=True)
        return o

    # the per-document loops run eagerly under --compile (a graph break, not a recompilation per batch's documents)
    @torch.compiler.disable
    def _core_documents(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        documents: Documents) -> Tensor:
        rule = self._rule(q.device.type)
        return torch.cat([torch.cat([rule(*(t[b:b + 1, s0:s1] for t in (q, k, v, g, beta)))[0]
                                     for s0, s1 in documents.segments(b)], dim=1)
                          for b in range(documents.batch)], dim=0)

    @torch.compiler.disable
    def _conv_documents(self, x_TBC: Tensor, documents: Documents, key_heads: slice) -> Tensor:
        """The causal convolution of each document alone (zero prefix at its start): ``[T, B, C]`` -> same."""
        return torch.cat([torch.cat([self.conv1d(x_TBC[s0:s1, b:b + 1], None, key_heads)[0]
                                     for s0, s1 in documents.segments(b)], dim=0)
                          for b in range(documents.batch)], dim=1)

    def _in_projections(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.in_proj_qkvz.forward_local(x), self.in_proj_ba.forward_local(x)

    def forward(self, x: Tensor, position_ids: Tensor, documents: Documents | None = None) -> Tensor:
        qkvz, ba = on_tp_input(x, self.tp_group, self.sequence_parallel, self._in_projections)   # SP: keep the shard
        S, B = qkvz.shape[:2]
        if position_ids.shape != (S,):
            raise ValueError(f"GatedDeltaNet: position_ids {tuple(position_ids.shape)} must be [{S}] (one position "
                             "per token of this rank's sequence, before the SP split)")
        c, hk, hv = self.config, self.local_key_heads, self.local_value_heads
        r, dk, dv = c.value_heads_per_key_head, c.key_head_dim, c.value_head_dim
        qkv, z = qkvz.view(S, B, hk, -1).split([c.conv_group_channels, r * dv], -1)
        ba = ba.view(S, B, hk, 2 * r)
        key_heads = value_heads = slice(None)
        if self.cp > 1:   # the whole sequence for 1/cp of the heads
            qkv, ba = heads_to_sequence(torch.cat([qkv, ba], dim=-1), self.cp_group).split([qkv.shape[-1], 2 * r], -1)
            hk, hv = hk // self.cp, hv // self.cp
            key_heads = slice(self.cp_rank * hk, (self.cp_rank + 1) * hk)
            value_heads = slice(self.cp_rank * hv, (self.cp_rank + 1) * hv)
        T = qkv.shape[0]   # the mixer's sequence: S, or the whole cp * S
        b, a = ba.split([r, r], dim=-1)
        cache = self.cache
        documents = documents if documents is not None and documents.isolate else None
        if documents is not None and (cache is not None or documents.seq_length != T or documents.batch != B):
            raise ValueError(f"GatedDeltaNet: documents of {documents.batch} samples of {documents.seq_length} tokens "
                             f"do not fit the mixer's [{T}, {B}] sequence (or a decoding cache is set)")
        if documents is not None:
            qkv = self._conv_documents(qkv.reshape(T, B, -1), documents, key_heads)
        else:
            qkv, prefix = self.conv1d(qkv.reshape(T, B, -1), None if cache is None else cache.conv, key_heads)
            if cache is not None:
                cache.conv = prefix
        q, k, v = qkv.view(T, B, hk, -1).split([dk, dk, r * dv], dim=-1)
        beta = torch.sigmoid(b).reshape(T, B, hv)
        A_log, dt_bias = self.A_log[value_heads].float(), self.dt_bias[value_heads].float()
        g = -A_log.exp() * F.softplus(a.float().reshape(T, B, hv) + dt_bias)
        # [T, B, ...] -> [B, T, ...] (fla's and HF's layout)
        q, k, v, g, beta = (t.transpose(0, 1) for t in (q, k, v.reshape(T, B, hv, dv), g, beta))
        # decoding (a cache) has no backward: the rule runs as is
        o = self._core(q, k, v, g, beta) if cache is not None else self.regions.core_attn(self._core, q, k, v, g, beta,
                                                                                         documents)
        o = o.transpose(0, 1)
        if self.cp > 1:   # back to this rank's tokens, every head
            o = sequence_to_heads(o, self.cp_group)
            hv = self.local_value_heads
        o = self.norm(o, z.reshape(S, B, hv, dv), copy_to_region(self.norm.weight, self.tp_group))
        return self.out_proj(o.reshape(S, B, hv * dv))

    def extra_repr(self) -> str:
        c = self.config
        return (f"key_heads={self.local_key_heads}/{c.num_key_heads}, value_heads={self.local_value_heads}/"
                f"{c.num_value_heads}, head_dims={c.key_head_dim}/{c.value_head_dim}, conv={c.conv_kernel_size}, "
                f"backend={c.backend}, sp={self.sequence_parallel}"
                f"{', recompute core_attn' if recomputes(self.regions.core_attn) else ''}")
