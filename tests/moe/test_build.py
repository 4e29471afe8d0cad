"""The MoE layer's parts from their configs (``moe.build``), and its one forward path.

- the builder makes each expert GEMM backend from ``ExpertsConfig`` (the CPU rows backend only for experts built
  on a CPU) and passes the parts into ``MoELayer``;
- ``MoELayer.forward`` runs exactly the staged pieces the overlap schedules run (a spy records every call of the
  layer's pieces and the dispatcher's methods), the shared experts while the dispatch exchange is in flight;
- a value's validity is checked in the config that owns it, strings (flags, YAML, saved runs) become enums there,
  and a saved run's config with the flat names loads to the same layer config.
"""

from __future__ import annotations

import json

import pytest
import torch

from moefold.dispatch import AllToAllDispatcher, DispatchConfig, DispatcherKind, FlexBackend
from moefold.moe.activation import ExpertActivation, GatedActivation
from moefold.moe.block_gemm import BlockScaledGroupedGemm
from moefold.moe.build import build_expert_gemm, build_experts, build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.cpu.backend import CpuRowsGemm
from moefold.moe.cpu.expert_rows import RowLayout
from moefold.moe.expert_gemm import Fp8Gemm, GroupedMMGemm, HostCountsGemm, SplitGemm, WeightGrads
from moefold.moe.experts import ExpertsRegions
from moefold.moe.fp8_gemm import Float8GroupedGemm
from moefold.moe.gemm import GemmBackend
from moefold.moe.router_config import RouterConfig
from moefold.moe.shared_experts import SharedExperts
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import init_parameters
from moefold.precision.fp8 import FP8Config
from tests.moe import te_standin

E, H, F = 4, 32, 16


def test_the_builder_makes_each_gemm_backend_from_its_config(monkeypatch):
    def gemm(device: str = "cpu", **kw):
        return build_expert_gemm(ExpertsConfig(F, **kw), E, H, F, device=device)

    cpu = gemm(row_layout="uniform")
    assert type(cpu) is CpuRowsGemm and cpu.row_layout is RowLayout.UNIFORM
    assert type(gemm("meta")) is GroupedMMGemm   # off the CPU: no CPU machinery on the path
    assert type(gemm(gemm_backend="loop")) is HostCountsGemm and gemm(gemm_backend="loop").backend is GemmBackend.LOOP
    fp8 = gemm(fp8=FP8Config("e4m3", "rowwise"))
    assert type(fp8) is Fp8Gemm and all(type(g) is Float8GroupedGemm for g in fp8.gemms)
    assert not fp8.needs_host_counts and gemm(gemm_backend="loop", fp8=FP8Config("e4m3")).needs_host_counts
    block = gemm(fp8=FP8Config("e4m3", "blockwise"))
    assert all(type(g) is BlockScaledGroupedGemm for g in block.gemms)
    assert type(gemm(fp8=FP8Config(dispatch=True))) is CpuRowsGemm   # FP8 dispatch alone: the GEMMs stay bf16
    te_standin.install(monkeypatch)
    from moefold.moe.te_gemm import TEExpertGemms

    te = gemm(gemm_backend="te")
    assert type(te) is TEExpertGemms and te.needs_host_counts and not te.fuses_wgrad
    # split backward: the backends' deferrable forms
    from moefold.dense.split_backward import WeightGradStore

    store = WeightGradStore()
    assert type(gemm().with_weight_grad_store(store)) is SplitGemm
    split_fp8 = fp8.with_weight_grad_store(store)   # torchao FP8 defers its own casts: a new Fp8Gemm, fp8 unchanged
    assert type(split_fp8) is Fp8Gemm and [g.store for g in split_fp8.gemms + fp8.gemms] == [store, store, None, None]
    with pytest.raises(ValueError, match="cannot defer the weight gradients of the 'te' expert GEMMs"):
        te.with_weight_grad_store(store)


def test_the_layer_gets_its_parts():
    cfg = MoEConfig(E, RouterConfig(num_experts=E, topk=2), ExpertsConfig(F, gemm_backend="loop"),
                    DispatchConfig(DispatcherKind.ALLTOALL, max_chunked_experts=0), SharedExpertsConfig(F, gate=True))
    layer = build_moe_layer(cfg, H, ParallelDims.single())
    assert type(layer.dispatcher) is AllToAllDispatcher and type(layer.experts.gemm) is HostCountsGemm
    assert type(layer.shared_experts) is SharedExperts and layer.shared_experts.gate is not None
    assert [n for n, _ in layer.named_parameters()][:2] == ["router.weight", "experts.w13"]
    with pytest.raises(ValueError, match="the router has 4 experts, the dispatcher 8, the experts 4"):
        type(layer)(layer.router, AllToAllDispatcher(8), layer.experts)


def _spied_layer(monkeypatch, kind: DispatcherKind) -> tuple[torch.nn.Module, list[str]]:
    cfg = MoEConfig(E, RouterConfig(num_experts=E, topk=2, aux_loss_coeff=0.01), ExpertsConfig(F),
                    DispatchConfig(kind), SharedExpertsConfig(F))
    layer = build_moe_layer(cfg, H, ParallelDims.single())
    init_parameters(layer, seed=1)
    calls: list[str] = []

    def spy(owner: object, name: str) -> None:
        real = getattr(owner, name)

        def recorded(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorded)

    for name in ("route_and_prepare", "shared_step", "experts_step", "combine_finish"):
        spy(layer, name)
    for name in ("prepare_dispatch", "dispatch_exchange", "finish_dispatch", "prepare_combine", "combine_exchange",
                 "finish_combine", "dispatch_start", "dispatch", "combine"):
        spy(layer.dispatcher, name)
    spy(layer.shared_experts, "forward")
    return layer, calls


@pytest.mark.parametrize("kind", [DispatcherKind.LOCAL, DispatcherKind.ALLGATHER, DispatcherKind.ALLTOALL])
def test_forward_runs_exactly_the_staged_pieces(monkeypatch, kind):
    """One path: forward is the pieces the overlap schedules run (route_and_prepare -> dispatch exchange ->
    experts_step -> combine exchange -> combine_finish), the shared experts after the dispatch exchange started
    and before its wait (finish_dispatch); no other form of a dispatch or combine runs."""
    layer, calls = _spied_layer(monkeypatch, kind)
    x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y, info = layer(x)
    (y.square().sum() + info.aux_loss).backward()
    assert calls == ["route_and_prepare", "prepare_dispatch", "dispatch_exchange", "shared_step", "forward",
                     "experts_step", "finish_dispatch", "prepare_combine", "combine_exchange", "combine_finish",
                     "finish_combine"], calls
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())


def test_choices_are_checked_once_in_their_config():
    with pytest.raises(ValueError, match="activation='relu' is not one of swiglu, gelu"):
        ExpertsConfig(F, activation="relu")
    with pytest.raises(ValueError, match=r"unknown gemm backend 'x' \(gemm_backend='x'"):
        ExpertsConfig(F, gemm_backend="x")
    with pytest.raises(ValueError, match="expert_row_layout='diagonal'"):
        ExpertsConfig(F, row_layout="diagonal")
    with pytest.raises(ValueError, match="shape the gated activation; activation='gelu' is not gated"):
        ExpertsConfig(F, activation="gelu", glu=GatedActivation(alpha=1.702))
    with pytest.raises(ValueError, match=r"expert biases .* not 'te'"):
        ExpertsConfig(F, gemm_backend="te", bias=True)
    with pytest.raises(ValueError, match="shared_expert_gate=True needs shared experts"):
        SharedExpertsConfig(0, gate=True)
    with pytest.raises(ValueError, match="activation='gelu' has no shared-expert form"):
        SharedExpertsConfig(F, activation="gelu")
    with pytest.raises(ValueError, match="activation='relu2' has no gate"):
        SharedExpertsConfig(F, clamp=7.0, activation="relu2")
    router = RouterConfig(num_experts=E, topk=2)
    padding = ExpertsConfig(F, fp8=FP8Config("e4m3", router_padding=True))
    with pytest.raises(ValueError, match=r"the flex \(DeepEP\) dispatcher does not take it"):
        MoEConfig(E, router, padding, DispatchConfig(DispatcherKind.FLEX))
    assert MoEConfig(E, router, padding).pad_multiple == 16
    experts = ExpertsConfig(F, activation="gelu", gemm_backend="loop", row_layout="packed")
    assert (experts.activation, experts.gemm_backend, experts.row_layout) == (
        ExpertActivation.GELU, GemmBackend.LOOP, RowLayout.PACKED)
    assert type(experts.activation) is ExpertActivation and type(experts.gemm_backend) is GemmBackend


def test_a_saved_run_config_loads_to_the_same_layer_config():
    """A run's config.json holds ModelOptions' flat fields as strings (old and new runs alike): it loads to the
    enums, writes the same strings back, and builds the same MoEConfig."""
    from moefold.models.layer_factory import moe_config
    from moefold.models.options import ModelOptions
    from moefold.models.recipes import get_recipe
    from moefold.parallel.dims import ParallelConfig
    from moefold.training.config import RunConfig, TrainConfig

    options = ModelOptions(dispatcher="flex", gemm_backend="loop", moe_flex_dispatcher_backend="deepep",
                           moe_deepep_num_sms=24, moe_deepep_mode="direct", moe_deepep_max_tokens_per_rank=64,
                           fp8=FP8Config("hybrid", dispatch=True))
    run = RunConfig(model=get_recipe("qwen3_moe_tiny"), parallel=ParallelConfig(), options=options,
                    train=TrainConfig())
    saved = json.loads(run.to_json())
    assert (saved["options"]["gemm_backend"], saved["options"]["dispatcher"],
            saved["options"]["moe_flex_dispatcher_backend"], saved["options"]["fp8"]["backend"]) == (
        "loop", "flex", "deepep", "torchao")
    again = RunConfig.from_dict(saved)
    assert again.options == options and again.to_json() == run.to_json()
    dims = ParallelDims.single()
    moe = moe_config(again.model, again.options, dims)
    assert moe == moe_config(run.model, options, dims)
    assert moe.dispatch == DispatchConfig(DispatcherKind.FLEX, moe.dispatch.flex, fp8=True)
    assert (moe.dispatch.flex.backend, moe.dispatch.flex.num_sms, moe.dispatch.flex.hybrid,
            moe.dispatch.flex.max_tokens_per_rank) == (FlexBackend.DEEPEP, 24, False, 64)
    assert moe.experts.gemm_backend is GemmBackend.LOOP and moe.experts.fp8 == options.fp8


def test_experts_take_their_strategies_through_configure():
    """The routed experts' strategies are objects installed by ``configure`` (the execution pass's only way in): the
    ``grouped_mm`` backend fuses its weight gradients and ``loop`` does not; the backend's SwiGLU runs until split
    backward swaps the backend for its split form; a bad name, kind or strategy is one line and changes nothing."""
    from moefold.dense.split_backward import WeightGradStore
    from moefold.execution.grad_accumulation import enable_grad_accumulation_fusion
    from moefold.execution.recompute import DISCARD_OUTPUT
    from moefold.moe.swiglu import swiglu_rows

    experts = build_experts(E, H, ExpertsConfig(F))
    assert enable_grad_accumulation_fusion(experts) == [""] and experts.weight_grads is WeightGrads.MAIN_GRAD
    loop = build_experts(E, H, ExpertsConfig(F, gemm_backend="loop"))
    assert enable_grad_accumulation_fusion(loop) == []
    with pytest.raises(ValueError, match=r"weight_grads=MAIN_GRAD .* not HostCountsGemm \(loop\)"):
        loop.configure(weight_grads=WeightGrads.MAIN_GRAD)

    assert experts._activation is swiglu_rows   # the grouped_mm backend's SwiGLU
    split = experts.gemm.with_weight_grad_store(WeightGradStore())
    with pytest.raises(ValueError, match="weight_grads=MAIN_GRAD"):   # split backward and fusion: not together
        experts.configure(gemm=split)
    assert experts.gemm is not split
    enable_grad_accumulation_fusion(experts, enabled=False)
    experts.configure(gemm=split)
    assert type(experts.gemm) is SplitGemm and experts._activation is experts._eager_activation

    with pytest.raises(ValueError, match=r"GroupedExperts.configure: 'shared_experts' is not one of its regions "
                                         r"\(expert_fc1, moe_act\)"):
        experts.configure(shared_experts=DISCARD_OUTPUT)
    with pytest.raises(ValueError, match="expert_fc1=DISCARD_OUTPUT is not a Region"):
        experts.configure(expert_fc1=DISCARD_OUTPUT)
    with pytest.raises(ValueError, match="weight_grads=True is not a WeightGrads"):
        experts.configure(weight_grads=True)
    with pytest.raises(ValueError, match="activation_kernel=True is not an ActivationKernel"):
        experts.configure(activation_kernel=True)
    with pytest.raises(ValueError, match="the gemm backend object runs 'loop', the config asks for 'grouped_mm'"):
        experts.configure(gemm=loop.gemm, moe_act=DISCARD_OUTPUT)
    assert experts.regions == ExpertsRegions() and type(experts.gemm) is SplitGemm   # nothing changed
    layer = build_moe_layer(MoEConfig(E, RouterConfig(E, 2), ExpertsConfig(F), shared=SharedExpertsConfig(F)), H,
                            ParallelDims.single())
    with pytest.raises(ValueError, match=r"MoELayer.configure: 'moe_act' is not one of its regions "
                                         r"\(shared_experts, router, preprocess, routing\)"):
        layer.configure(moe_act=DISCARD_OUTPUT)
