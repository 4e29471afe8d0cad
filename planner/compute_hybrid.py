"""Compute seconds of one layer of a one-sublayer stack (Nemotron-H): a Mamba-2 mixer, GQA attention, an MoE layer
or a dense MLP, each alone; and of a Gated DeltaNet block (Qwen3-Next, Qwen3.5-MoE) (``planner.compute_time.
block_compute`` hands those layers here).

GEMM by GEMM as ``compute_time`` times them, with the shapes one rank sees:

- Mamba-2: ``in_proj`` ``[rows, (inner + conv_channels + heads) / tp]`` (z, x, B, C, dt; column-parallel over whole
  groups) and ``out_proj`` ``[rows, H]`` from ``inner / tp`` (row-parallel); the depthwise convolution is
  elementwise; the chunked scan (``dense.ssd_scan``) is core work at attention's efficiency: per token and local
  head the two ``head_dim x state`` products of the state's update and read-out, plus the chunk's causal products
  (``C . B`` over ``state`` and its weighted sum over ``head_dim``, on average ``(chunk + 1) / 2`` earlier tokens);
- attention: ``compute_time``'s GQA GEMMs and ``score_macs`` core products;
- Gated DeltaNet (Qwen3-Next's ``linear_attention`` layers, two-part blocks: kind ``"linear_attention moe"`` or
  ``"linear_attention dense"``, the mixer and the block's FFN): ``in_proj_qkvz`` ``[rows, hk (2 dk + 2 r dv) / tp]``,
  ``in_proj_ba`` ``[rows, 2 hv / tp]`` (column-parallel) and ``out_proj`` ``[rows, H]`` from ``hv dv / tp``
  (row-parallel); the chunked delta rule (``dense.gated_delta_rule``, fla's kernel the same algorithm) at
  attention's efficiency: per token and local value head the three ``dk x dv`` state products (the keys' and the
  queries' reads, the write) and the chunk's causal products over on average ``(chunk + 1) / 2`` earlier tokens
  (``k_beta k^T`` and ``q k^T`` over ``dk``, the two triangular solves over ``dk`` and ``dv``, the intra-chunk
  output over ``dv``);
- MoE and dense MLP: ``compute_time``'s, with squared-ReLU's one up projection (``[rows, f]``, not SwiGLU's
  ``[rows, 2f]``) when ``ffn_activation`` is ``relu2``.

Elementwise kernels: one norm and one residual add over ``H`` per layer, the mixer's or FFN's activations (the
SiLU over the convolution's channels, the gated norm over ``inner``; the FFN's as ``compute_time`` counts them).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from moefold.models.config import ModelConfig
from moefold.parallel.dims import ParallelSizes
from moefold.planner.activations_deltanet import CHUNK
from moefold.planner.cluster import Cluster
from moefold.planner.compute_time import (
    ELEMENTWISE_SHARE,
    BlockCompute,
    Gemm,
    _attention_gemms,
    _ffn_gemms,
    core_attention_seconds,
    elementwise_bytes,
    gemm_parts,
    gemm_seconds_sum,
)
from moefold.planner.gemm_efficiency import attention_seconds
from moefold.training.config import RunConfig


def mamba_scan_macs(m: ModelConfig, tp: int) -> float:
    """Per token, on one rank: the chunked scan's multiply-adds (module docstring)."""
    d = m.hybrid.mamba
    heads = d.num_heads / tp
    return heads * (2 * d.head_dim * d.state_size + (d.chunk_size + 1) / 2 * (d.state_size + d.head_dim))


def deltanet_rule_macs(m: ModelConfig, tp: int) -> float:
    """Per token, on one rank: the chunked delta rule's multiply-adds (module docstring)."""
    la = m.linear_attention
    dk, dv = la.key_head_dim, la.value_head_dim
    return la.num_value_heads / tp * (3 * dk * dv + (CHUNK + 1) / 2 * (3 * dk + 2 * dv))


def _deltanet_gemms(m: ModelConfig, rows: float, tp: int) -> tuple[list[Gemm], float]:
    """(the mixer's GEMMs, its elementwise bytes per token): the convolution and its SiLU over the convolved
    channels, the gated norm over the values."""
    la, H = m.linear_attention, m.hidden_size
    keys, values = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    gemms = [Gemm("deltanet", rows, (2 * keys + 2 * values) / tp, H),
             Gemm("deltanet", rows, 2 * la.num_value_heads / tp, H), Gemm("deltanet", rows, H, values / tp)]
    return gemms, (6 * (2 * keys + values) + 8 * values) / tp


def _layer_gemms(config: RunConfig, sizes: ParallelSizes, kind: str) -> tuple[list[Gemm], float]:
    """(the GEMMs, elementwise bytes per token) of a ``kind`` layer for one micro-batch on one rank."""
    m, t = config.model, config.train
    H, tp = m.hidden_size, sizes.tp
    rows = t.micro_batch_size * t.seq_length / sizes.cp
    elementwise = 2 * (4 * H) + 6 * H   # one norm (read, write), one residual add
    if kind == "mamba":
        d = m.hybrid.mamba
        gemms = [Gemm("mamba", rows, (d.inner_size + d.conv_channels + d.num_heads) / tp, H),
                 Gemm("mamba", rows, H, d.inner_size / tp)]
        return gemms, elementwise + (6 * d.conv_channels + 8 * d.inner_size) / tp
    if kind == "full_attention":
        return _attention_gemms(m, rows, tp), elementwise
    if kind.startswith("linear_attention"):   # a two-part block: the mixer, then the block's FFN
        mixer, mixer_bytes = _deltanet_gemms(m, rows, tp)
        moe = kind.endswith("moe")
        heads = m.num_attention_heads * m.attention_head_dim   # no RoPE in a DeltaNet layer
        block_bytes = elementwise_bytes(m, moe, config.options.fp8.enabled) - 2 * (4 * heads)
        return mixer + _ffn_gemms(m, moe, rows, rows / tp, sizes), block_bytes + mixer_bytes
    moe = kind == "moe"
    gemms = _ffn_gemms(m, moe, rows, rows / tp, sizes)
    if m.ffn_activation == "relu2":
        gemms = [dataclasses.replace(g, n=g.n / 2) if i in _up_indices(m, moe) else g for i, g in enumerate(gemms)]
    F = m.moe_ffn_hidden_size * m.moe_topk + m.moe_shared_expert_ffn_size if moe else m.ffn_hidden_size
    return gemms, elementwise + 6 * F


def _up_indices(m: ModelConfig, moe: bool) -> tuple[int, ...]:
    """Positions of the gate + up GEMMs in ``compute_time._ffn_gemms``' list: the MLP's first; the experts' first
    projection after the router and, with a shared expert, the shared expert's first (after the latent pair)."""
    if not moe:
        return (0,)
    latent = 2 if (m.moe_latent_size or m.hidden_size) != m.hidden_size else 0
    return (1,) + ((3 + latent,) if m.moe_shared_expert_ffn_size else ())


@lru_cache(maxsize=1024)
def hybrid_block_compute(config: RunConfig, sizes: ParallelSizes, kind: str, cluster: Cluster, score_macs: float,
                         recompute: frozenset[str], flops_only: float | None) -> BlockCompute:
    """Seconds of one ``kind`` layer (``ModelConfig.layer_type``) for one micro-batch on one rank."""
    m, t = config.model, config.train
    tokens = t.micro_batch_size * t.seq_length / (sizes.tp * sizes.cp)
    gemms, elementwise = _layer_gemms(config, sizes, kind)
    core_macs = 0.0
    if kind == "mamba":
        core_macs = mamba_scan_macs(m, sizes.tp) * t.micro_batch_size * t.seq_length / sizes.cp
    elif kind.startswith("linear_attention"):
        core_macs = deltanet_rule_macs(m, sizes.tp) * t.micro_batch_size * t.seq_length / sizes.cp
    elif kind == "full_attention":
        core_macs = score_macs * tokens
    fwd, bwd, again, shared = gemm_seconds_sum(config, gemms, cluster, recompute, flops_only)
    if flops_only:
        core = 2 * core_macs / flops_only
        core_bwd = 2 * core
    else:
        if kind == "full_attention":   # softmax attention: its tensor cores' part and its exponentials
            core, core_bwd = core_attention_seconds(m, cluster, 2 * core_macs)
        else:
            core = attention_seconds(cluster, 2 * core_macs, False)
            core_bwd = attention_seconds(cluster, 2 * core_macs, True)
        ew_s = elementwise * tokens / (ELEMENTWISE_SHARE * cluster.hbm_gbps * 1e9)
        fwd, bwd = fwd + ew_s, bwd + 2 * ew_s
    mixer_core = kind == "full_attention" or kind.startswith("linear_attention")   # what core_attn recomputes
    if "core_attn" in recompute and mixer_core:
        again += core
    gemm, grouped = gemm_parts(config, gemms, cluster, recompute, flops_only)
    return BlockCompute(forward=fwd + core, backward=bwd + core_bwd, recompute=again,
                        core_attention=core if mixer_core else 0.0, shared_experts=shared, gemm=gemm, grouped=grouped)


__all__ = ["deltanet_rule_macs", "hybrid_block_compute", "mamba_scan_macs"]
