"""Building a run's model and optimizer: the ``ModelOptions`` the run's flags make, this rank's model (its pipeline
stage's chunks at pp > 1), the execution pass's plan (``execution_plan``: recompute, offload, FP8, split backward,
fusion, compile, FSDP2, applied by ``moefold.execution.apply_execution`` once the weights are in), and its gradient
sync and distributed optimizer (or FSDP2's). The trainer builds its parts here, and ``moefold plan`` builds the
same ones on the meta device to count their bytes (``planner.static``).

What crosses ranks: ``build_optimizer`` is collective (the embedding group of the pipeline's shared weights, the
optimizer's shard layout); building the model is not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moefold.dispatch.config import DispatcherKind
from moefold.dispatch.flex_backend import FlexBackend
from moefold.execution import ExecutionPlan, FSDPPlan, FSDPSharding
from moefold.execution.cuda_graph import CudaGraphImpl, CudaGraphPlan
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.moe.router import Router
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group
from moefold.pipeline import build_schedule, simulate
from moefold.pipeline.decoder_stage import build_stage_model, shared_weight_groups
from moefold.pipeline.stages import chunk_costs
from moefold.training.checkpoint.files import checkpoint_dirs, is_checkpoint_dir
from moefold.training.config import RunConfig
from moefold.training.optim.grad_sync import GradSync
from moefold.training.optim.muon import DistributedMuon, is_muon_matrix
from moefold.training.optim.optimizer import DistributedAdamW

if TYPE_CHECKING:
    from moefold.pipeline.schedules import Schedule
    from moefold.pipeline.stages import StageLayout
    from moefold.training.config import TrainConfig


def moe_routers(model: MoEDecoder) -> dict[int, Router]:
    """{global layer index: router} of this stage's MoE layers (MTP depth k: num_layers + k - 1)."""
    out: dict[int, Router] = {}
    blocks = [(int(i), b) for i, b in model.layers.items()] + [(m.index, m.block) for m in model.mtp]
    for i, block in blocks:
        for mod in block.modules():
            if isinstance(mod, Router):
                out[i] = mod
    return out


def model_options(config: RunConfig) -> ModelOptions:
    """The run's ``ModelOptions`` (``--bf16`` / ``--fp16`` make the parameters bf16 / fp16; the flex dispatcher's
    ``moe_deepep_max_tokens_per_rank`` is the tokens one rank routes per MoE call: micro-batch x sequence /
    (tp x cp), every rank the same)."""
    options = config.options
    dtype = "bf16" if config.train.bf16 else "fp16" if config.train.fp16 else options.dtype
    if options.dtype != dtype:
        options = dataclasses.replace(options, dtype=dtype)
    if config.train.qk_clip and not options.max_attention_logit:   # MuonClip reads each head's largest logit
        options = dataclasses.replace(options, max_attention_logit=True)
    if not options.moe_deepep_max_tokens_per_rank:
        t, p = config.train, config.parallel
        options = dataclasses.replace(options, moe_deepep_max_tokens_per_rank=max(
            1, t.micro_batch_size * t.seq_length // (p.tp * p.cp)))
    return options


def flex_backend(config: RunConfig, dims: ParallelDims) -> FlexBackend | None:
    """The flex dispatcher's backend this run's MoE layers use (``dispatch.flex_backend``), None without flex."""
    options = config.options
    if not config.model.num_experts or options.resolved_dispatcher(dims.ep, dims.etp) is not DispatcherKind.FLEX:
        return None
    from moefold.dispatch.flex_backend import resolve_flex_backend

    return resolve_flex_backend(options.moe_flex_dispatcher_backend)


def build_model(config: RunConfig, dims: ParallelDims, device: torch.device | str) -> MoEDecoder:
    """This rank's model (its pipeline stage's chunks at pp > 1) on ``device``, not yet initialised. The trainer
    and ``moefold plan`` (on the meta device) both build it here."""
    options = model_options(config)
    if dims.pp > 1:
        return build_stage_model(config.model, dims, options, config.pipeline_layout(dims.pp), device=device)
    return MoEDecoder(config.model, dims, options, device=device)


def execution_plan(config: RunConfig, dims: ParallelDims, *, accounting: bool = False) -> ExecutionPlan:
    """What the execution pass applies to this rank's model: the model options' recompute, offload and FP8 choices;
    split backward for the zero-bubble schedules and ``--delay-wgrad-compute``; gradient-accumulation fusion
    (not with split backward, whose deferred weight gradients accumulate autograd's way, nor under FSDP2); compile;
    FSDP2. ``accounting``: for a meta model that ``moefold plan`` counts (no compile, no sharding)."""
    t = config.train
    split = config.split_backward(dims.pp)
    fsdp = FSDPPlan(t.optimizer_precision().dtype("main_grads"), pipelined=dims.pp > 1) if t.use_torch_fsdp2 else None
    return ExecutionPlan(model_options(config), split_backward=split,
                         grad_accumulation_fusion=t.gradient_accumulation_fusion and not split and fsdp is None,
                         compile=t.compile and not accounting, fsdp=None if accounting else fsdp,
                         cuda_graphs=None if accounting else cuda_graph_plan(config, dims))


def cuda_graph_plan(config: RunConfig, dims: ParallelDims) -> CudaGraphPlan | None:
    """``--cuda-graph-impl``'s plan, or None; ValueError (one line) for a run whose steps keep host state between
    micro-batches that a replayed graph would not update (the model's own refusals: ``ExecutionPlan``,
    ``execution.cuda_graph.moe_refusal``)."""
    t = config.train
    if t.cuda_graph_impl == "none":
        return None
    plan = CudaGraphPlan(CudaGraphImpl(t.cuda_graph_impl), frozenset(t.cuda_graph_modules), t.cuda_graph_warmup_steps)
    full = plan.impl is CudaGraphImpl.FULL_ITERATION
    blockers = (
        (dims.pp > 1, f"pp={dims.pp}: a pipeline schedule keeps several micro-batches in flight, each needing its "
                      "own static buffers, and exchanges activations between stages on the host's schedule"),
        (t.overlap_param_gather, "--overlap-param-gather: each module's forward pre-hook waits on the host for its "
                                 "parameters' all-gather"),
        (full and t.fp16, "--fp16: the loss scale changes from step to step, and a captured step would keep the "
                          "first one"),
        (full and t.moe_max_load_ratio is not None, "--moe-max-load-ratio: the per-micro-batch loads are new "
                                                    "tensors each step"),
        (t.reset_attention_mask or t.reset_position_ids, "--reset-attention-mask / --reset-position-ids: each "
                                                           "batch's document boundaries plan its attention calls on "
                                                           "the host"),
        (t.moe_routing_replay_file is not None, "--moe-routing-replay-file: each micro-batch replays its own recorded "
                                                 "expert ids, which the host feeds to the router between steps"),
        (full and t.overlap_grad_reduce and dims.world_size > 1,
         "the overlapped gradient reduction: its buckets launch from hooks counting on the host (pass "
         "--no-overlap-grad-reduce)"),
    )
    for blocked, why in blockers:
        if blocked:
            raise ValueError(f"--cuda-graph-impl {plan.impl.value} cannot be combined with {why}")
    return plan


def build_optimizer(model: MoEDecoder, config: RunConfig, dims: ParallelDims, sharding: FSDPSharding | None = None,
                    ) -> tuple[Group, GradSync, DistributedAdamW | DistributedMuon]:
    """(embedding group, GradSync, DistributedAdamW) of ``model``: the flat buffers, buckets and optimizer slices
    whose bytes ``training.observe.memory.static_bytes`` counts. Collective (the embedding group); ``moefold plan``
    runs it on a meta-device model. ``sharding``: the execution pass's FSDP2 sharding (``--use-torch-fsdp2``)."""
    t = config.train
    layout = config.pipeline_layout(dims.pp) if dims.pp > 1 else None
    shared = shared_weight_groups(model, dims, layout)
    if t.use_torch_fsdp2:   # FSDP2 shards parameters, gradients and states instead (training.optim.fsdp)
        from moefold.training.optim.fsdp import build_fsdp

        if "output_head" in shared:
            raise ValueError(f"--use-torch-fsdp2 with --pipeline-model-parallel-layout "
                             f"{t.pipeline_model_parallel_layout!r}: FSDP2 sums only the embedding's pipeline copies, "
                             f"not an untied output head's on a standalone MTP stage; put m and L on one stage")
        if sharding is None:
            raise ValueError("--use-torch-fsdp2: the model is not sharded; run the execution pass (execution_plan, "
                             "moefold.execution.apply_execution) before building the optimizer")
        return shared.get("embed_tokens"), *build_fsdp(model, config, dims, shared.get("embed_tokens"), sharding)
    precision = t.optimizer_precision()
    # a module that two chunks of this rank read, each backpropagated on its own (the V placement's rank 0 with
    # MTP or a tied head, a layout's MTP chunk on the embedding's rank), accumulates one gradient per chunk
    # split backward defers weight gradients to W actions that accumulate autograd's way: no fusion there (the
    # execution pass fused the GEMMs by the same rule, ``execution_plan``)
    fusion = t.gradient_accumulation_fusion and not config.split_backward(dims.pp)
    reports = {}
    if layout is not None and layout.vpp > 1:
        readers = {"embed_tokens": layout.embedding_chunks(config.model.tie_word_embeddings),
                   "output_head": layout.output_head_chunks()}
        for name, chunks in readers.items():
            mine = sum(c.pp_rank == dims.pp_rank for c in chunks)
            module = getattr(model, name)
            if mine > 1 and module is not None:
                reports.update({f"{name}.{n}": mine for n, _ in module.named_parameters()})
    muon = t.muon_options()
    sync = GradSync(model.named_parameters(), dims, bucket_numel=t.bucket_numel, overlap=t.overlap_grad_reduce,
                    grad_dtype=precision.dtype("main_grads"), copies_groups=shared, reports=reports,
                    fusion=fusion, whole=is_muon_matrix if muon is not None else None)
    if muon is not None:   # --optimizer muon: Muon on the matrices this rank owns whole, AdamW on the rest
        return shared.get("embed_tokens"), sync, DistributedMuon(
            sync, dims, options=muon, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
            weight_decay=t.weight_decay, precision=precision, model=model, overlap_param_gather=t.overlap_param_gather)
    optimizer = DistributedAdamW(sync, dims, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                 weight_decay=t.weight_decay, precision=precision, model=model,
                                 overlap_param_gather=t.overlap_param_gather,
                                 cpu_offload_fraction=t.optimizer_offload_fraction if t.optimizer_cpu_offload else None)
    return shared.get("embed_tokens"), sync, optimizer


def micro_batches(n: int) -> str:
    """``"1 micro-batch"``, ``"4 micro-batches"``."""
    return f"{n} micro-batch" if n == 1 else f"{n} micro-batches"


def build_pipeline(config: RunConfig, dims: ParallelDims, num_micro: int, log: Callable[[str], None],
                   ) -> tuple[StageLayout | None, Schedule | None]:
    """(layout, schedule) of the run's pipeline over ``num_micro`` micro-batches per step, stated in one line
    through ``log``; (None, None) at pp = 1 without the batch-level overlap."""
    overlap = config.train.overlap_moe_expert_parallel_comm
    if dims.pp > 1:
        layout = config.pipeline_layout(dims.pp)
        vpp = layout.vpp
        pipeline = build_schedule(config.schedule_name(vpp), dims.pp, num_micro, vpp, overlap=overlap,
                                  chunk_costs=chunk_costs(layout))
        bubble = simulate(pipeline).bubble_fraction
        # the placement means something only for several chunks per rank (zb-h1 at vpp 1 is not "interleaved")
        chunks = f" x vpp {vpp} ({layout.placement.value} placement)" if vpp > 1 else ""
        log(f"pipeline: {pipeline.name}{' (FB pairs overlapped)' if overlap else ''} schedule, pp "
            f"{dims.pp}{chunks}, {micro_batches(num_micro)} per step "
            f"(bubble {bubble:.1%} with stage times by layer count, backward = 2 x forward)\n"
            f"--pipeline-model-parallel-layout {layout.text!r}:\n{layout.describe()}")
        return layout, pipeline
    if overlap:   # pp = 1: Megatron's combined 1F1B without pipelining, F0, FB(1, 0), ..., B(m-1)
        layout, pipeline = config.pipeline_layout(1), build_schedule("1f1b", 1, num_micro, overlap=True)
        log(f"batch-level overlap: {micro_batches(num_micro)} as F0, FB(1, 0), ..., B({num_micro - 1})")
        return layout, pipeline
    return None, None


def load_initial_weights(model: MoEDecoder, train: TrainConfig) -> None:
    """``--load-hf`` / ``--load-megatron``: this rank's slices of those weights into ``model`` (initialised), unless
    the run resumes from ``--load``: a resume overwrites them (whether its checkpoints are intact is
    ``Trainer.load``'s to find out)."""
    resuming = train.load is not None and (is_checkpoint_dir(Path(train.load)) or bool(checkpoint_dirs(train.load)))
    if train.load_hf and not resuming:
        from moefold.models.pretrained import load_pretrained_weights

        load_pretrained_weights(model, train.load_hf, upcycle=train.moe_use_upcycling)  # this rank's slices
    if train.load_megatron and not resuming:
        from moefold.models.megatron import load_megatron_weights

        load_megatron_weights(model, train.load_megatron)   # this rank's slices of the torch_dist tensors
