"""Host synchronisations per MoE layer (forward + backward), counted on CPU as they would happen on CUDA.

``moefold.training.observe.host_sync.HostSyncCounter`` counts the aten operators and Python-level reads
that make the host wait for a GPU (scalar reads, device->host copies, host->device copies of
Python data, data-dependent output sizes, bincount). Budgets, per MoE layer, router + dispatch +
grouped experts (grouped_mm, bf16: its grouped kernel's dtype on CUDA) + combine + shared experts,
forward and backward together:

    local dispatcher      0 (dropless and padded), 1 in unpadded capacity mode (the kept count)
    alltoall dropless     1 (the split sizes of the exchange)     alltoall padded     0
    allgather             1 (the gathered header of counts)
    flex, DeepEP V2       0 (sync-free: the received counts stay on the device), 1 with --moe-deepep-cpu-sync
    flex, deepep-legacy   1 (DeepEP's dispatch waits on the host for the received counts)

The flex counts run on the CPU stand-ins of DeepEP (tests/dispatch/deepep_*standin.py), whose own bookkeeping
is paused (DeepEP's C++) while the host wait DeepEP makes is counted, as it would be on a GPU.

A training step's count is printed and bounded in test_training_step_host_syncs.
"""

from __future__ import annotations

import dataclasses

import torch

from moefold.dispatch.config import DispatchConfig, FlexOptions
from moefold.moe.activation import GatedActivation
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import init_parameters
from moefold.training.observe.host_sync import HostSyncCounter
from tests.dispatch import deepep_elastic_standin, deepep_standin
from tests.distributed import run_distributed

E, H, F = 8, 16, 16


def _router(mode: str, bias: bool = False) -> RouterConfig:
    capacity = {} if mode == "dropless" else {"expert_capacity_factor": 1.0,
                                              "pad_expert_input_to_capacity": mode == "padded"}
    return RouterConfig(num_experts=E, topk=2, aux_loss_coeff=0.01, z_loss_coeff=1e-3, bias=bias, **capacity)


# GPT-OSS's experts: router bias, expert biases (each row's expert from repeat_interleave with output_size), clamp
GPT_OSS = dict(bias=True, glu=GatedActivation(alpha=1.702, clamp=7.0, linear_offset=1.0))


def _layer_syncs(dispatcher: str, mode: str, dims: ParallelDims, backend: str = "grouped_mm",
                 dtype: torch.dtype = torch.bfloat16, gpt_oss: bool = False,
                 flex: FlexOptions | None = None) -> HostSyncCounter:
    """One MoE layer's forward + backward counted; ``flex``: the flex dispatcher's options (the DeepEP stand-in in
    ``sys.modules``)."""
    experts = ExpertsConfig(F, gemm_backend=backend, **(GPT_OSS if gpt_oss else {}))
    cfg = MoEConfig(num_experts=E, router=_router(mode, bias=gpt_oss), experts=experts,
                    dispatch=DispatchConfig(dispatcher, flex or FlexOptions()), shared=SharedExpertsConfig(F))
    layer = build_moe_layer(cfg, H, dims, sequence_parallel=False, dtype=dtype)
    init_parameters(layer, seed=0)
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(dims.rank)).to(dtype).requires_grad_()
    syncs = HostSyncCounter()
    deepep_standin.HOST_WORK = deepep_elastic_standin.HOST_WORK = syncs.paused   # DeepEP's C++ bookkeeping
    with syncs:
        y, info = layer(x)
        (y.square().sum() + info.aux_loss).backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())
    return syncs


def test_local_dispatcher_host_syncs():
    dims = ParallelDims.single()
    for mode, budget in (("dropless", 0), ("padded", 0), ("drop", 1)):
        for gpt_oss in (False, True):   # GPT-OSS's biases and activation add none
            syncs = _layer_syncs("local", mode, dims, gpt_oss=gpt_oss)
            assert syncs.total == budget, f"local {mode} gpt_oss={gpt_oss}: {syncs.total} host syncs, budget " \
                                          f"{budget}\n{syncs.report()}"
    # a backend that takes host counts reads them once when the dispatcher has none on the host
    syncs = _layer_syncs("local", "dropless", dims, backend="loop")
    assert syncs.total == 1, syncs.report()
    # fp32: torch's grouped_mm has no fp32 grouped kernel on CUDA; its fallback reads the offsets
    # on the host in each of the 2 GEMMs' 3 calls (forward, grad input, grad weight)
    syncs = _layer_syncs("local", "dropless", dims, dtype=torch.float32)
    assert syncs.total == 6 and set(syncs.counts) == {next(iter(syncs.counts))}, syncs.report()


def _multi_rank(layouts: list[tuple[int, int]]) -> list[str]:
    failures = []
    budgets = {("alltoall", "dropless"): 1, ("alltoall", "drop"): 1, ("alltoall", "padded"): 0,
               ("allgather", "dropless"): 1, ("allgather", "drop"): 1, ("allgather", "padded"): 1}
    for ep, etp in layouts:
        dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
        for (dispatcher, mode), budget in budgets.items():
            for backend in ("grouped_mm", "loop"):  # loop takes host counts: from the dispatcher, no extra sync
                syncs = _layer_syncs(dispatcher, mode, dims, backend)
                if syncs.total != budget:
                    failures.append(f"{dispatcher} {mode} ep{ep} etp{etp} {backend}: {syncs.total} host syncs, "
                                    f"budget {budget}\n{syncs.report()}")
    return failures


def test_alltoall_and_allgather_host_syncs():
    # ep4 uses the chunked exchange (e = 2 local experts), ep2 x etp2 the sorted one
    results = run_distributed(_multi_rank, 4, [(4, 1), (2, 2)], timeout=300)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures)


def _flex(layouts: list[tuple[int, int]]) -> list[str]:
    import sys

    failures = []
    sys.modules["deep_ep"] = deepep_elastic_standin.module()   # DeepEP 2.x: ElasticBuffer and the legacy Buffer
    budgets = {("deepep", None, "dropless"): 0, ("deepep", None, "drop"): 0, ("deepep", None, "padded"): 0,
               ("deepep", True, "dropless"): 1, ("deepep-legacy", None, "dropless"): 1,
               ("deepep-legacy", None, "drop"): 1}
    for ep, etp in layouts:
        dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
        for (backend, cpu_sync, mode), budget in budgets.items():
            flex = FlexOptions(backend, max_tokens_per_rank=12, cpu_sync=cpu_sync)
            syncs = _layer_syncs("flex", mode, dims, flex=flex)
            if syncs.total != budget:
                failures.append(f"flex {backend} cpu_sync={cpu_sync} {mode} ep{ep} etp{etp}: {syncs.total} host "
                                f"syncs, budget {budget}\n{syncs.report()}")
    # with the GPT-OSS biases (their rows' experts from the device counts) still none
    dims = ParallelDims.build(ParallelConfig(ep=2, etp=2))
    syncs = _layer_syncs("flex", "dropless", dims, gpt_oss=True, flex=FlexOptions("deepep", max_tokens_per_rank=12))
    if syncs.total:
        failures.append(f"flex deepep gpt-oss ep2 etp2: {syncs.total} host syncs, budget 0\n{syncs.report()}")
    from moefold.dispatch.flex_backend import destroy_deepep_buffers

    destroy_deepep_buffers()
    return failures


def test_flex_host_syncs():
    """0 per MoE layer on DeepEP V2 (sync-free), 1 with its CPU sync, 1 on the legacy backend."""
    results = run_distributed(_flex, 4, [(4, 1), (2, 2)], timeout=300)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures)


def test_counter_sees_what_synchronises():
    """The counter itself: each kind of sync is counted once, and device-side work is not."""
    x = torch.arange(8)
    with HostSyncCounter() as syncs:
        x.tolist()
        x.to("cpu")
        x.cpu()
        int(x[1])
        _ = x[x > 2]
        torch.nonzero(x)
        torch.bincount(x)
        x.repeat_interleave(x)
        x.new_tensor([1, 2])
        torch.tensor([1, 2], device=x.device)
    assert syncs.total == 10, syncs.report()
    with HostSyncCounter() as syncs:
        torch.tensor([1, 2])  # a host tensor by intent
        x.to(x.device)
        x.repeat_interleave(x, output_size=28)
        x.repeat_interleave(2)
        torch.zeros(8, dtype=torch.long).scatter_add_(0, x, torch.ones_like(x))
        x.argsort(stable=True)
        torch.histc(x.float(), bins=4, min=0, max=8)
        w = torch.randn(2, 16, 8, dtype=torch.bfloat16)
        torch.nn.functional.grouped_mm(torch.randn(6, 16, dtype=torch.bfloat16), w,
                                       offs=torch.tensor([2, 6], dtype=torch.int32))
    assert syncs.total == 0, syncs.report()
    with HostSyncCounter() as syncs:  # fp32: torch's fallback
        torch.nn.functional.grouped_mm(torch.randn(6, 16), w.float(), offs=torch.tensor([2, 6], dtype=torch.int32))
    assert syncs.total == 1, syncs.report()
    assert x.to.__self__ is x  # the wrappers are gone after the block


def test_training_step_host_syncs():
    """A whole bf16 optimizer step (4 micro-batches through DeepSeek-V3-tiny: MLA, MoE with the local
    dispatcher, shared experts, MTP, expert bias): printed, and bounded by the trainer's own reads
    (one copy of the logged values and grad norm, two of the per-layer expert loads).

    Not seen on CPU: the batch's host->device copy (``.to(device)`` of a tensor made from numpy
    looks like a same-device move here); the GPU check counts it under CUDA's sync debug mode.
    """
    from moefold.training.trainer import Trainer
    from tests.training.trainer_common import tiny_config, tiny_data

    config = tiny_config(steps=2, bf16=True)  # bf16 (--bf16): the grouped GEMM kernel's dtype on CUDA
    config = dataclasses.replace(config, options=dataclasses.replace(config.options, dtype="bf16"))
    trainer = Trainer(config, ParallelDims.single(), log=lambda _m: None)
    data = tiny_data()
    trainer.fit(data, stop_at=1)  # first step: lazy initialisation outside the count
    with HostSyncCounter() as syncs:
        trainer.fit(data, stop_at=2)
    per_step = syncs.total
    print(f"host syncs per training step (deepseek_v3_tiny bf16, 4 micro-batches, world 1): {per_step}\n"
          f"{syncs.report()}")
    assert per_step <= 3, f"{per_step} host syncs per step, bound 3:\n{syncs.report()}"
