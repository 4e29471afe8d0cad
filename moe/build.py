"""The one builder of the MoE layer's parts: ``MoEConfig`` + layout -> router, dispatcher, experts, shared experts.

    layer = build_moe_layer(config, hidden_size, dims, sequence_parallel=True, dtype=None, device=None)
    # MoELayer(router, dispatcher, experts, shared_experts, tp_group=..., sequence_parallel=..., ...)

Each part is built from its own config: the router from ``RouterConfig`` (``moe.router``), the dispatcher from
``DispatchConfig`` (``dispatch.factory.build_dispatcher``: it also takes the hidden size and what the experts' GEMMs
want of its rows), the experts from ``ExpertsConfig`` through ``build_experts`` (the GEMM backend first,
``build_expert_gemm``, then ``GroupedExperts`` around it), the shared experts from ``SharedExpertsConfig``. The parts
are made in that order (their weights' first draws from torch's generator; ``init_parameters`` redraws them
layout-independently anyway). Nothing here crosses ranks.
"""

from __future__ import annotations

import torch

from moefold.dispatch.factory import build_dispatcher
from moefold.moe.block_gemm import BlockScaledGroupedGemm, check_expert_blocks
from moefold.moe.config import ExpertsConfig, MoEConfig
from moefold.moe.expert_gemm import ExpertGemm, Fp8Gemm, GemmCall, GroupedMMGemm, HostCountsGemm
from moefold.moe.experts import GroupedExperts
from moefold.moe.fp8_gemm import Float8GroupedGemm
from moefold.moe.gemm import GemmBackend, check_gemm_backend
from moefold.moe.hash_router import HashRouter
from moefold.moe.latent import LatentProjection
from moefold.moe.layer import MoELayer
from moefold.moe.router import Router, RouterGroups
from moefold.moe.shared_experts import SharedExperts
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group, group_size
from moefold.precision.fp8 import FP8Backend


def _on_cpu(device: torch.device | str | None) -> bool:
    return (torch.get_default_device() if device is None else torch.device(device)).type == "cpu"


def build_expert_gemm(config: ExpertsConfig, num_local_experts: int, hidden_size: int, ffn_local: int, *,
                      etp_group: Group = None, token_group: Group = None, dtype: torch.dtype | None = None,
                      device: torch.device | str | None = None) -> ExpertGemm[GemmCall]:
    """The GEMM backend ``config`` asks for, for ``num_local_experts`` experts of ``hidden_size`` x ``ffn_local``
    (this etp rank's FFN slice) with weights of ``dtype`` on ``device``. Checks that it can run here (ImportError /
    ValueError / RuntimeError naming what to install or use)."""
    check_gemm_backend(config.gemm_backend, dtype)
    fp8 = config.fp8_gemms
    if fp8 is not None:
        fp8.check_available()
    gates = config.activation.gates
    if config.gemm_backend is GemmBackend.TE:
        from moefold.moe.te_gemm import TEExpertGemms  # lazy: imports transformer_engine

        return TEExpertGemms(num_local_experts, hidden_size, gates * ffn_local, ffn_local, dtype, fp8)
    if fp8 is not None and fp8.backend is FP8Backend.TORCHAO:   # etp splits w13's rows (M) and w2's columns (K)
        grouped = config.gemm_backend is GemmBackend.GROUPED_MM
        if fp8.block_scaled:   # blockwise / mxfp8 / nvfp4: moe.block_gemm
            check_expert_blocks(fp8, ffn_local, group_size(etp_group))
            gemm_cls: type[Float8GroupedGemm | BlockScaledGroupedGemm] = BlockScaledGroupedGemm
        else:
            gemm_cls = Float8GroupedGemm
        return Fp8Gemm(config.gemm_backend,
                       gemm_cls(fp8, grouped=grouped, m_group=etp_group, token_group=token_group),
                       gemm_cls(fp8, grouped=grouped, k_group=etp_group, token_group=token_group))
    if config.gemm_backend is GemmBackend.GROUPED_MM:
        if _on_cpu(device):
            from moefold.moe.cpu.backend import CpuRowsGemm

            return CpuRowsGemm(config.row_layout)
        return GroupedMMGemm()
    return HostCountsGemm(config.gemm_backend)


def build_experts(num_experts: int, hidden_size: int, config: ExpertsConfig, *, ep_group: Group = None,
                  etp_group: Group = None, token_group: Group = None, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> GroupedExperts:
    """``GroupedExperts`` for ``config`` over ``ep_group`` x ``etp_group`` with its GEMM backend.
    ``token_group``: the ranks that hold these experts and split one micro-batch's tokens
    (``ParallelDims.expert_token_group``): torchao FP8 scales over token rows reduce over it."""
    e, f = GroupedExperts.local_shape(num_experts, hidden_size, config.ffn_hidden_size, group_size(ep_group),
                                      group_size(etp_group))
    gemm = build_expert_gemm(config, e, hidden_size, f, etp_group=etp_group, token_group=token_group, dtype=dtype,
                             device=device)
    return GroupedExperts(num_experts, hidden_size, config, gemm, ep_group=ep_group, etp_group=etp_group, dtype=dtype,
                          device=device)


def build_moe_layer(config: MoEConfig, hidden_size: int, dims: ParallelDims, *, sequence_parallel: bool = True,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                    hash_vocab_size: int | None = None) -> MoELayer:
    """The MoE layer ``config`` describes over the layout ``dims`` (attention tp for tokens, etp x ep for experts).
    ``sequence_parallel``: the layer's input is the tp rank's sequence shard (only matters at tp > 1).
    ``hash_vocab_size``: a hash-routed layer (``moe.hash_router``) whose table has that many token rows."""
    if not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"MoELayer: hidden_size={hidden_size!r} must be a positive integer")
    config.check_layout(tp=dims.tp, ep=dims.ep, etp=dims.etp)
    sp = sequence_parallel and dims.tp > 1
    # The router marks its weight sequence-parallel itself: every tp rank routes distinct tokens.
    groups = RouterGroups.from_dims(dims)
    router = (Router(config.router, hidden_size, groups, device=device) if hash_vocab_size is None else
              HashRouter(config.router, hidden_size, hash_vocab_size, groups, device=device))
    fp8 = config.experts.fp8_gemms
    width = config.latent_size or hidden_size   # what the exchange moves and the experts take
    dispatcher = build_dispatcher(config.dispatch, config.num_experts, dims, hidden_size=width,
                                  expert_alignment=fp8.group_alignment if fp8 is not None else 1,
                                  experts_read_host_counts=config.experts.reads_host_counts)
    experts = build_experts(config.num_experts, width, config.experts, ep_group=dims.ep_group,
                            etp_group=dims.etp_group, token_group=dims.expert_token_group, dtype=dtype, device=device)
    latent = None
    if config.latent_size is not None:   # Megatron: fc1 with init_method, fc2 with output_layer_init_method
        e = config.experts
        latent = (LatentProjection(hidden_size, width, e.init_std, dtype=dtype, device=device),
                  LatentProjection(width, hidden_size, e.output_init_std or e.init_std, seed=1, dtype=dtype,
                                   device=device))
    shared = None
    if config.shared is not None:
        s = config.shared
        shared = SharedExperts(hidden_size, s.ffn_size, tp_group=dims.tp_group, sequence_parallel=sp, gate=s.gate,
                               init_std=s.init_std, output_init_std=s.output_init_std, clamp=s.clamp,
                               activation=s.activation, dtype=dtype, device=device)
    return MoELayer(router, dispatcher, experts, shared, tp_group=dims.tp_group, sequence_parallel=sp,
                    apply_probs_on_input=config.apply_probs_on_input, pad_multiple=config.pad_multiple, latent=latent)


__all__ = ["build_expert_gemm", "build_experts", "build_moe_layer"]
