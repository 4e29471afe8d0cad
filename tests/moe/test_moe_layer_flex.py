"""The MoE layer with the flex dispatcher on DeepEP V2 (the ``ElasticBuffer`` CPU stand-in) equals the world-1 layer.

Outputs, input gradients and every parameter gradient, at ep2 (x edp2), ep4 and ep2 x etp2 in one 4-rank world, with
and without FP8 dispatch and with ``expert_alignment`` 1 and 16 (the FP8 GEMMs' multiple), in dropless and capacity
mode, with ``--moe-apply-probs-on-input`` (unweighted experts), and with GPT-OSS's expert biases (the rows past
the experts' blocks, which sync-free dispatch allocates for the worst case, must not reach a bias gradient). The
reference is each dp rank's micro-batch through the world-1 layer with the local dispatcher (FP8 dispatch there is
the same cast round trip); DeepEP moves bf16, so both run in bf16 and compare at bf16's tolerance. Also: one DeepEP
buffer for every layer, and ``MoEOutputInfo.received_E`` (DeepEP's received counts) summed over the ranks equals the
routed copies.
The protocol itself (calls, events, host syncs): tests/dispatch/test_flex_elastic.py.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from moefold.dispatch.config import DispatchConfig, DispatcherKind, FlexOptions
from moefold.dispatch.flex_backend import FlexBackend
from moefold.moe.activation import GatedActivation
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.experts import is_expert
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, init_parameters, shards_of
from tests.dispatch import deepep_elastic_standin
from tests.distributed import run_distributed

E, H, FFN, S, B, DP = 8, 32, 16, 4, 8, 4   # every rank's micro-batch: [S, B / DP, H]
GPT_OSS = dict(bias=True, glu=GatedActivation(alpha=1.702, clamp=7.0, linear_offset=1.0))


def _config(dispatcher: str, fp8: bool, capacity: bool = False, gpt_oss: bool = False,
            probs_on_input: bool = False) -> MoEConfig:
    extra = {"expert_capacity_factor": 1.0} if capacity else {}
    router = RouterConfig(num_experts=E, topk=1 if probs_on_input else 2, init_std=0.3, aux_loss_coeff=0.01,
                          bias=gpt_oss, pre_softmax=probs_on_input, **extra)
    flex = FlexOptions(FlexBackend.DEEPEP, max_tokens_per_rank=S * B // DP)
    experts = ExpertsConfig(FFN, init_std=0.4, **(GPT_OSS if gpt_oss else {}))
    return MoEConfig(num_experts=E, router=router, experts=experts,
                     dispatch=DispatchConfig(dispatcher, flex, fp8=fp8), shared=SharedExpertsConfig(FFN, init_std=0.4),
                     apply_probs_on_input=probs_on_input)


def _micro_batch(d: int):
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    return x.chunk(DP, dim=1)[d].to(torch.bfloat16), gy.chunk(DP, dim=1)[d].to(torch.bfloat16)


def _build(cfg: MoEConfig, dims: ParallelDims) -> MoELayer:
    layer = build_moe_layer(cfg, H, dims, sequence_parallel=False, dtype=torch.bfloat16)
    init_parameters(layer, seed=11)
    return layer


def _reference(cfg: MoEConfig):
    layer = _build(dataclasses.replace(cfg, dispatch=dataclasses.replace(cfg.dispatch, kind=DispatcherKind.LOCAL)),
                   ParallelDims.single())
    outs = []
    for d in range(DP):
        x, gy = _micro_batch(d)
        x.requires_grad_()
        y, info = layer(x)
        ((y.float() * gy.float()).sum() + info.aux_loss).backward()
        outs.append((y.detach().float(), x.grad.float()))
    return outs, {n: p.grad.float() for n, p in layer.named_parameters()}


def _close(got: torch.Tensor, want: torch.Tensor, label: str, failures: list[str]) -> None:
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    if got.shape != want.shape or not torch.allclose(got, want, atol=3e-2 * scale, rtol=0):
        err = (got - want).abs().max() if got.shape == want.shape else f"shape {tuple(got.shape)}"
        failures.append(f"{label}: max err {err} (scale {scale:.3g})")


def _world() -> list[str]:
    from moefold.dispatch import build_dispatcher
    from moefold.dispatch.deepep_elastic import ELASTIC_BUFFERS

    standin = deepep_elastic_standin.module()
    sys.modules["deep_ep"] = standin
    failures: list[str] = []
    refs: dict[MoEConfig, tuple] = {}
    groups: set = set()
    cases = [(ep, etp, fp8, align, False, False, False) for ep, etp in ((2, 1), (4, 1), (2, 2))
             for fp8 in (False, True) for align in (1, 16)]
    cases += [(4, 1, False, 1, True, False, False), (2, 2, False, 16, False, True, False),
              (2, 2, True, 1, True, True, False), (2, 2, False, 1, False, False, True)]   # last: probs on input
    for ep, etp, fp8, align, capacity, gpt_oss, on_input in cases:
        label = f"ep{ep} etp{etp} fp8={fp8} align={align} capacity={capacity} gpt_oss={gpt_oss} on_input={on_input}"
        cfg = _config("flex", fp8, capacity, gpt_oss, on_input)
        if cfg not in refs:
            refs[cfg] = _reference(cfg)
        ref_out, ref_grads = refs[cfg]
        dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
        layer = _build(cfg, dims)
        if align != 1:   # as FP8 GEMMs would set it (FP8Config.group_alignment), on bf16 GEMMs here
            layer.dispatcher = build_dispatcher(cfg.dispatch, E, dims, hidden_size=H, expert_alignment=align)
        made = len(standin.ElasticBuffer.instances)
        x, gy = _micro_batch(dims.dp_rank)
        with torch.no_grad():   # a second MoE layer of the same layout: it shares the first one's buffer
            _build(cfg, dims)(x)
        x.requires_grad_()
        y, info = layer(x)
        want = 0 if dims.etp_ep_group in groups else 1   # one per group (a layout's groups are built once)
        groups.add(dims.etp_ep_group)
        if len(standin.ElasticBuffer.instances) - made != want:
            failures.append(f"{label}: {len(standin.ElasticBuffer.instances) - made} new DeepEP buffers for two "
                            f"layers, expected {want}")
        ((y.float() * gy.float()).sum() + info.aux_loss).backward()
        _close(y.float(), ref_out[dims.dp_rank][0], f"{label} output", failures)
        _close(x.grad.float(), ref_out[dims.dp_rank][1], f"{label} input grad", failures)
        for name, p in layer.named_parameters():
            grad = p.grad.float()
            dist.all_reduce(grad, group=dims.edp_group if is_expert(p) else dims.dp_group)
            _close(gather_full(grad, shards_of(p)), ref_grads[name], f"{label} grad {name}", failures)
        received, routed = info.received_E.double(), info.load_E.double()
        dist.all_reduce(received)
        dist.all_reduce(routed)
        if not capacity and not torch.equal(received, routed):
            failures.append(f"{label}: received_E over the ranks {received.tolist()}, routed {routed.tolist()}")
        if capacity and not (received <= routed).all():
            failures.append(f"{label}: received more than routed in capacity mode")
    ELASTIC_BUFFERS.destroy()
    return failures


def test_moe_layer_on_deepep_v2_equals_world1():
    results = run_distributed(_world, 4, timeout=600)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures[:40])
