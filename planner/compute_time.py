"""Compute seconds of one block on one rank, GEMM by GEMM at each shape's own efficiency.

``block_compute(config, sizes, index, cluster)`` lists the GEMMs one micro-batch runs through block ``index`` on
one rank, with the shapes that rank sees (``Gemm``: ``[m, k] @ [k, n]``, ``groups`` equal problems in one grouped
kernel), and times each with ``planner.gemm_efficiency`` in its dtype: FP8 where the run's FP8 recipe
covers the module (``ModelOptions.fp8``: every linear but the excluded ones, e.g. the output head; the router
always in high precision), bf16 otherwise. Backward is the input gradient ``[m, n] @ [n, k]`` plus the weight
gradient ``[n, m] @ [m, k]`` of every GEMM, each with its own shape. Shapes per rank:

- attention and dense MLPs: the micro-batch's tokens of the rank's context-parallel chunk (sequence parallelism
  gathers the tp shards before the GEMM), output (column-parallel) or input (row-parallel) features / tp; MLA's
  down-projections (``q_a``, ``kv_a``) are replicated over tp as in Megatron;
- routed experts: balanced routing, ``E / ep`` local experts of ``tokens x topk x ep x etp / E`` rows each (the
  rows of the ep x etp ranks' tokens that pick the expert), ``F / etp`` features, one grouped GEMM per projection;
- core attention (scores and values): ``gemm_efficiency.softmax_attention_seconds`` at the heads' width
  (``head_dims``: d_qk + d_v), the tensor cores' part and the exponentials';
- the elementwise kernels (norms, residual adds, RoPE, the SwiGLU activation, permutation, FP8 casts): HBM-bound,
  ``ELEMENTWISE_BYTES`` per token, at ``ELEMENTWISE_SHARE`` of the HBM bandwidth; backward twice the forward.

``flops_only`` replaces all of that by ``FLOPs / (bf16 peak x efficiency)`` (``moefold plan --efficiency``, the
flat model). Nothing here crosses ranks: the collectives are ``planner.comm``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from moefold.models.config import ModelConfig
from moefold.models.layer_factory import is_moe_block
from moefold.parallel.dims import ParallelSizes
from moefold.planner.cluster import Cluster
from moefold.planner.gemm_efficiency import gemm_seconds, softmax_attention_seconds
from moefold.training.config import RunConfig

ELEMENTWISE_SHARE = 0.7   # of the HBM bandwidth: fused elementwise kernels on Hopper reach 70-90%


@dataclass(frozen=True)
class Gemm:
    """``groups`` x ``[m, k] @ [k, n]`` of module ``module`` (a recompute module name, or the layer part)."""

    module: str
    m: float
    n: float
    k: float
    groups: int = 1
    fp8_capable: bool = True   # False: kept in high precision whatever the FP8 recipe (the router)

    @property
    def flops(self) -> float:
        return 2.0 * self.groups * self.m * self.n * self.k


@dataclass(frozen=True)
class BlockCompute:
    """Seconds of one micro-batch through one block on one rank."""

    forward: float
    backward: float
    recompute: float        # what selective recompute runs again in backward (chosen modules)
    core_attention: float   # forward core attention (what cp's p2p exchange hides behind)
    shared_experts: float   # forward shared experts (what the expert exchange hides behind)
    # of (forward, backward, recompute): the GEMMs' seconds, and of those the grouped expert GEMMs' (``groups > 1``),
    # which ``step_terms.Calibration`` scales apart from the rest (zero in the flat model, which is not calibrated)
    gemm: tuple[float, float, float] = (0.0, 0.0, 0.0)
    grouped: tuple[float, float, float] = (0.0, 0.0, 0.0)


def _attention_gemms(c: ModelConfig, rows: float, tp: int) -> list[Gemm]:
    H, nh = c.hidden_size, c.num_attention_heads
    if c.attention == "mla":
        a = c.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        out = []
        if a.q_lora_rank:
            out += [Gemm("attention", rows, a.q_lora_rank, H), Gemm("mla_up_proj", rows, nh * qk / tp, a.q_lora_rank)]
        else:
            out.append(Gemm("attention", rows, nh * qk / tp, H))
        return [*out, Gemm("attention", rows, a.kv_lora_rank + a.qk_rope_head_dim, H),
                Gemm("mla_up_proj", rows, nh * (a.qk_nope_head_dim + a.v_head_dim) / tp, a.kv_lora_rank),
                Gemm("attention", rows, H, nh * a.v_head_dim / tp)]
    d = c.attention_head_dim
    q = nh * d * (2 if c.attention_output_gate else 1)
    return [Gemm("attention", rows, (q + 2 * c.kv_heads * d) / tp, H), Gemm("attention", rows, H, nh * d / tp)]


def _ffn_gemms(c: ModelConfig, moe: bool, rows: float, sp_rows: float, sizes: ParallelSizes) -> list[Gemm]:
    H, tp = c.hidden_size, sizes.tp
    if not moe:
        F = c.ffn_hidden_size
        return [Gemm("mlp", rows, 2 * F / tp, H), Gemm("mlp", rows, H, F / tp)]
    E, F = c.num_experts, c.moe_ffn_hidden_size
    local = max(1, E // sizes.ep)
    per_expert = sp_rows * c.moe_topk * sizes.ep * sizes.etp / E
    W = c.moe_latent_size or H   # latent experts: the experts at width W, two projections around them
    out = [Gemm("moe", sp_rows, E, H, fp8_capable=False),
           Gemm("moe", per_expert, 2 * F / sizes.etp, W, local), Gemm("moe", per_expert, W, F / sizes.etp, local)]
    if W != H:
        out += [Gemm("moe", sp_rows, W, H), Gemm("moe", sp_rows, H, W)]
    if c.moe_shared_expert_ffn_size:
        Fs = c.moe_shared_expert_ffn_size
        out += [Gemm("shared_experts", rows, 2 * Fs / tp, H), Gemm("shared_experts", rows, H, Fs / tp)]
    return out


def head_dims(c: ModelConfig) -> float:
    """d_qk + d_v of one attention head: what one score costs the tensor cores, over two FLOPs, forward (MLA's query
    and key carry the rope part)."""
    if c.attention == "mla":
        return c.mla.qk_nope_head_dim + c.mla.qk_rope_head_dim + c.mla.v_head_dim
    return 2.0 * c.attention_head_dim


def core_attention_seconds(c: ModelConfig, cluster: Cluster, flops: float) -> tuple[float, float]:
    """(forward, backward) seconds of softmax attention whose forward is ``flops``."""
    dims = head_dims(c)
    return (softmax_attention_seconds(cluster, flops, dims, False),
            softmax_attention_seconds(cluster, flops, dims, True))


def elementwise_bytes(c: ModelConfig, moe: bool, fp8: bool) -> float:
    """HBM bytes per token of one block's forward elementwise kernels (bf16 activations): two norms and two
    residual adds over ``H``; RoPE over q and k; for an MoE block the permutation and weighted unpermutation of
    ``topk`` copies and the SwiGLU activation (read ``2F``, write ``F`` per copy), for a dense one the activation
    once; with FP8 each GEMM input cast once (read 2, write 1 byte per element)."""
    H = c.hidden_size
    heads = c.num_attention_heads * (c.mla.qk_rope_head_dim if c.attention == "mla" else c.attention_head_dim)
    total = 2 * (4 * H) + 2 * (6 * H) + 2 * (4 * heads)
    if moe:
        k, F = c.moe_topk, c.moe_ffn_hidden_size
        total += 2 * (2 * H + 2 * k * H) + 6 * k * F
        casts = 3 * H + k * (H + F)
        if c.moe_shared_expert_ffn_size:
            total += 6 * c.moe_shared_expert_ffn_size
    else:
        total += 6 * c.ffn_hidden_size
        casts = 3 * H + c.ffn_hidden_size
    return total + (3 * casts if fp8 else 0)


def block_gemms(config: RunConfig, sizes: ParallelSizes, index: int) -> list[Gemm]:
    """The GEMMs of block ``index`` (an MTP block past ``num_layers``: with its 2H -> H projection) for one
    micro-batch on one rank."""
    m = config.model
    if m.layer_type(index) == "linear_attention" and not m.hybrid.one_sublayer:   # a Gated DeltaNet block
        from moefold.planner.activations_mamba import block_kind
        from moefold.planner.compute_hybrid import _layer_gemms

        return _layer_gemms(config, sizes, block_kind(m, index))[0]
    return list(_gemms(config, sizes, is_moe_block(m, index), index >= m.num_layers))


@lru_cache(maxsize=1024)
def _gemms(config: RunConfig, sizes: ParallelSizes, moe: bool, mtp: bool) -> tuple[Gemm, ...]:
    m, t = config.model, config.train
    rows = t.micro_batch_size * t.seq_length / sizes.cp
    sp_rows = rows / sizes.tp
    gemms = _attention_gemms(m, rows, sizes.tp) + _ffn_gemms(m, moe, rows, sp_rows, sizes)
    if mtp:
        gemms.append(Gemm("mtp", rows, m.hidden_size / sizes.tp, 2 * m.hidden_size))
    return tuple(gemms)


def _fp8(config: RunConfig, module: str, g: Gemm) -> bool:
    f = config.options.fp8
    return f.enabled and g.fp8_capable and not any(x in module for x in f.exclude_modules)


def _seconds(cluster: Cluster, g: Gemm, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of one GEMM."""
    fwd = gemm_seconds(cluster, dtype, g.m, g.n, g.k, g.groups)
    bwd = gemm_seconds(cluster, dtype, g.m, g.k, g.n, g.groups) + gemm_seconds(cluster, dtype, g.n, g.k, g.m, g.groups)
    return fwd, bwd


def gemm_seconds_sum(config: RunConfig, gemms, cluster: Cluster, recompute: frozenset[str],
                     flops_only: float | None) -> tuple[float, float, float, float]:
    """(forward, backward, recomputed forward, shared experts' forward) seconds of a block's ``gemms``: each at its
    dtype's roofline (FP8 where the recipe covers its module), or at ``flops_only`` FLOP/s."""
    fwd = bwd = again = shared = 0.0
    for g in gemms:
        if flops_only:
            f, b = g.flops / flops_only, 2 * g.flops / flops_only
        else:
            f, b = _seconds(cluster, g, "fp8" if _fp8(config, g.module, g) else "bf16")
        fwd, bwd = fwd + f, bwd + b
        if g.module in recompute or ("moe" in recompute and g.module == "shared_experts"):
            again += f
        if g.module == "shared_experts":
            shared += f
    return fwd, bwd, again, shared


def gemm_parts(config: RunConfig, gemms, cluster: Cluster, recompute: frozenset[str],
               flops_only: float | None) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """((forward, backward, recomputed forward) seconds of all of ``gemms``, the same of their grouped expert GEMMs
    (``groups > 1``)): what ``BlockCompute.gemm`` and ``BlockCompute.grouped`` hold; zeros in the flat model."""
    if flops_only:
        return (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)
    f, b, again, _ = gemm_seconds_sum(config, gemms, cluster, recompute, None)
    gf, gb, gagain, _ = gemm_seconds_sum(config, [g for g in gemms if g.groups > 1], cluster, recompute, None)
    return (f, b, again), (gf, gb, gagain)


def head_compute(config: RunConfig, sizes: ParallelSizes, cluster: Cluster, flops_only: float | None) -> tuple[float,
                                                                                                             float]:
    """(forward, backward) seconds of the output head for one micro-batch (kept in bf16 unless the FP8 recipe's
    excluded modules leave ``output_head`` out)."""
    m, t = config.model, config.train
    g = Gemm("output_head", t.micro_batch_size * t.seq_length / sizes.cp, m.vocab_size / sizes.tp, m.hidden_size)
    if flops_only:
        return g.flops / flops_only, 2 * g.flops / flops_only
    return _seconds(cluster, g, "fp8" if _fp8(config, "output_head", g) else "bf16")


def block_compute(config: RunConfig, sizes: ParallelSizes, index: int, cluster: Cluster, score_macs: float,
                  recompute: frozenset[str], flops_only: float | None = None) -> BlockCompute:
    """Seconds of block ``index`` (module docstring). ``score_macs``: core attention's multiply-adds per token;
    ``recompute``: the selectively recomputed modules; ``flops_only``: FLOP/s of the flat model, or None."""
    m = config.model
    if m.hybrid.one_sublayer and index < m.num_layers:   # Nemotron-H: one sub-layer per layer
        from moefold.planner.compute_hybrid import hybrid_block_compute

        return hybrid_block_compute(config, sizes, m.layer_type(index), cluster, score_macs, recompute, flops_only)
    if m.layer_type(index) == "linear_attention":   # Qwen3-Next: a Gated DeltaNet mixer, then the FFN
        from moefold.planner.activations_mamba import block_kind
        from moefold.planner.compute_hybrid import hybrid_block_compute

        return hybrid_block_compute(config, sizes, block_kind(m, index), cluster, score_macs, recompute, flops_only)
    return _block_compute(config, sizes, is_moe_block(m, index), index >= m.num_layers, cluster, score_macs,
                          recompute, flops_only)


@lru_cache(maxsize=4096)   # a model's blocks come in few kinds; the search times thousands of layouts
def _block_compute(config: RunConfig, sizes: ParallelSizes, moe: bool, mtp: bool, cluster: Cluster,
                   score_macs: float, recompute: frozenset[str], flops_only: float | None) -> BlockCompute:
    m, t = config.model, config.train
    tokens = t.micro_batch_size * t.seq_length / (sizes.tp * sizes.cp)
    core_flops = 2 * score_macs * tokens
    gemms = _gemms(config, sizes, moe, mtp)
    fwd, bwd, again, shared = gemm_seconds_sum(config, gemms, cluster, recompute, flops_only)
    if flops_only:
        core = core_flops / flops_only
        core_bwd = 2 * core
    else:
        core, core_bwd = core_attention_seconds(m, cluster, core_flops)
        ew_s = elementwise_bytes(m, moe, config.options.fp8.enabled) * tokens / (ELEMENTWISE_SHARE * cluster.hbm_gbps
                                                                                 * 1e9)
        fwd, bwd = fwd + ew_s, bwd + 2 * ew_s
    if "core_attn" in recompute:
        again += core
    gemm, grouped = gemm_parts(config, gemms, cluster, recompute, flops_only)
    return BlockCompute(forward=fwd + core, backward=bwd + core_bwd, recompute=again, core_attention=core,
                        shared_experts=shared, gemm=gemm, grouped=grouped)


__all__ = ["ELEMENTWISE_SHARE", "BlockCompute", "Gemm", "block_compute", "block_gemms", "core_attention_seconds",
           "elementwise_bytes", "gemm_parts", "gemm_seconds_sum", "head_compute", "head_dims"]
