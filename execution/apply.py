"""The execution pass: every cross-cutting feature applied to a built model, in one documented order.

    execution = apply_execution(model, ExecutionPlan(options, split_backward=..., compile=..., fsdp=...))

``model`` is a ``MoEDecoder`` (the whole model or this rank's pipeline stage), built, its weights initialised or
loaded. The order, and why:

1. **recompute** (``execution.recompute``): the selective regions of every layer, and the decoder's ``layers``
   run under full recompute. First: offloading composes around what it installs.
2. **activation offload** (``execution.activation_offload``): the chosen regions of every block run in an
   ``OffloadRegion`` of one offloader (around a checkpoint region in force); the ``layers`` run brackets chunks.
3. **FP8 linears** (``execution.fp8_linear``): each linear's GEMM becomes an FP8 GEMM (the experts take theirs
   from the MoE config when they are built). Before 4 and 5, which wrap or keep the GEMM installed here.
4. **split backward** (``execution.split_backward``): the linears' GEMMs and the routed experts defer their weight
   gradients to the model's ``WeightGradStore`` (zero-bubble schedules, ``--delay-wgrad-compute``).
5. **gradient-accumulation fusion** (``execution.grad_accumulation``): the plain linears' and the experts' weight
   gradients go into the main-grad slots (the slots come from the trainer's ``GradSync`` later). Not with 4 (the
   plan refuses both) nor with FSDP2 (it owns the gradients).
6. **compile** (``execution.compile``): ``torch.compile`` per block, tracing the regions and GEMMs in force.
7. **CUDA graphs** (``execution.cuda_graph``, ``execution.step_graph``): ``local`` / ``transformer_engine`` install
   a graphed region per ``--cuda-graph-modules`` scope, last of the regions so that it captures every GEMM and
   region installed before; ``full_iteration`` hands the trainer a ``StepGraph``. Refused with 1, 2, 4, 5, 6 and 8
   (``ExecutionPlan``): they keep host state or hooks that a replay would not run.
8. **FSDP2** (``execution.fsdp``): ``fully_shard`` unit by unit, last: its hooks must not be traced into compiled
   code, and it replaces the parameters every earlier step saw. Collective.

Every feature reaches a layer through the layer's own ``configure(...)`` (``dense.regions``; the MoE layer and its
routed experts alike). The pass runs once per model; nothing crosses ranks except FSDP2's sharding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moefold.dense.choices import Recompute
from moefold.dense.split_backward import WeightGradStore
from moefold.execution.activation_offload import apply_activation_offload
from moefold.execution.compile import CompileReport, compile_model
from moefold.execution.cuda_graph import (
    CudaGraphImpl,
    CudaGraphPlan,
    CudaGraphs,
    apply_cuda_graphs,
    impl_unavailable,
    step_refusal,
)
from moefold.execution.fp8_linear import convert_linears_to_fp8
from moefold.execution.fsdp import FSDPPlan, FSDPSharding, shard_model
from moefold.execution.grad_accumulation import enable_grad_accumulation_fusion
from moefold.execution.offloader import ActivationOffloader
from moefold.execution.recompute import FullRecompute, apply_recompute
from moefold.execution.split_backward import install_weight_grad_store
from moefold.execution.step_graph import StepGraph
from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelDims
from moefold.precision.fp8 import FP8Backend


@dataclass(frozen=True)
class ExecutionPlan:
    """What the pass applies. ``options``: the model's ``ModelOptions`` (recompute, offload and FP8 choices, each
    validated there); ``split_backward``: give the model a ``WeightGradStore``; ``grad_accumulation_fusion``: fused
    weight-gradient GEMMs; ``compile``: ``torch.compile`` the blocks; ``fsdp``: shard with FSDP2 (None: no);
    ``cuda_graphs``: what to capture (``--cuda-graph-impl``; None: nothing)."""

    options: ModelOptions = field(default_factory=ModelOptions)
    split_backward: bool = False
    grad_accumulation_fusion: bool = False
    compile: bool = False
    fsdp: FSDPPlan | None = None
    cuda_graphs: CudaGraphPlan | None = None

    def __post_init__(self) -> None:
        if self.split_backward and self.grad_accumulation_fusion:
            raise ValueError("ExecutionPlan: split_backward and grad_accumulation_fusion together: deferred weight "
                             "gradients accumulate autograd's way; fuse without split backward only")
        if self.fsdp is not None and (self.compile or self.grad_accumulation_fusion):
            raise ValueError("ExecutionPlan: fsdp with compile or grad_accumulation_fusion: FSDP2 owns the "
                             "gradients, and its hooks must not be traced into compiled blocks")
        why = self.cuda_graph_refusal()
        if why is not None:
            raise ValueError(why)

    def cuda_graph_refusal(self) -> str | None:
        """Why ``cuda_graphs`` cannot be captured with the other features (one line), or None."""
        g = self.cuda_graphs
        if g is None or g.impl is CudaGraphImpl.NONE:
            return None
        o, flag = self.options, f"--cuda-graph-impl {g.impl.value}"
        blockers = (
            (self.compile, "--compile: torch.compile's own graphs and guards run outside a captured graph"),
            (self.fsdp is not None, "--use-torch-fsdp2: its hooks gather and free parameters on the host around "
                                    "every unit"),
            (self.split_backward, "split backward (zero-bubble schedules, --delay-wgrad-compute): the deferred "
                                  "weight gradients run outside the captured backward"),
            (self.grad_accumulation_fusion, "--gradient-accumulation-fusion: the fused weight-gradient GEMMs choose "
                                            "on the host whether to write or add each micro-batch, state a replay "
                                            "does not update (pass --no-gradient-accumulation-fusion)"),
            (o.recompute is not Recompute.NONE, f"--recompute-granularity {o.recompute}: checkpointed regions save "
                                                "and restore the RNG state on the host"),
            (bool(o.offload_modules), "--fine-grained-activation-offloading: its copies are driven by host-side "
                                      "bookkeeping per micro-batch"),
            (o.fp8.backend is FP8Backend.TE and (o.fp8.format is not None or o.fp8.fp4 is not None),
             "--fp8-backend te: Transformer Engine's autocast updates its amax histories and scales around every "
             "forward, which only TE's own capture (its fp8 arguments, not wired here) keeps; torchao's FP8 is "
             "captured"),
        )
        for blocked, why in blockers:
            if blocked:
                return f"{flag} cannot be combined with {why}"
        return impl_unavailable(g.impl)


@dataclass
class Execution:
    """What the pass did: the offloader (None without offloading), the weight-gradient store (None without split
    backward), the compile report, the FP8 linears' and fused modules' names, the FSDP2 sharding, the per-scope CUDA
    graphs (``local``/``transformer_engine``) or the step's graph (``full_iteration``) the trainer runs its step in."""

    offloader: ActivationOffloader | None = None
    weight_store: WeightGradStore | None = None
    compiled: CompileReport | None = None
    fp8_linears: list[str] = field(default_factory=list)
    fused: list[str] = field(default_factory=list)
    fsdp: FSDPSharding | None = None
    cuda_graphs: CudaGraphs | None = None
    step_graph: StepGraph | None = None


def apply_execution(model: MoEDecoder, plan: ExecutionPlan, dims: ParallelDims | None = None, *,
                    log: Callable[[str], None] = print) -> Execution:
    """Apply ``plan`` to ``model`` in place, in the order of the module docstring. ``dims``: the model's grid (the
    tp group of the FP8 linears' sequence shard, FSDP2's meshes; default: the model's own). ``log``: the compile
    report's line."""
    dims = dims or model.dims
    o = plan.options
    done = Execution()
    apply_recompute(model, model.layers, o)
    if o.recompute == Recompute.FULL:
        model.configure(layers=FullRecompute(o, model.regions.layers))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    done.offloader = apply_activation_offload(model, o.offload_modules, o.min_offloaded_tensor_size, device)
    done.fp8_linears = convert_linears_to_fp8(model, o.fp8, dims.tp_group)
    if plan.split_backward:
        done.weight_store = WeightGradStore()
        install_weight_grad_store(model, done.weight_store)
    if plan.grad_accumulation_fusion:
        done.fused = enable_grad_accumulation_fusion(model)
    if plan.compile:
        done.compiled = compile_model(model, log=log)
    g = plan.cuda_graphs
    if g is not None and g.per_layer:
        done.cuda_graphs = apply_cuda_graphs(model, g, device)
    elif g is not None and g.impl is CudaGraphImpl.FULL_ITERATION:
        why = step_refusal(model)
        if why is not None:
            raise ValueError(why)
        done.step_graph = StepGraph(g.warmup_steps, device)
    if g is not None and g.impl is not CudaGraphImpl.NONE and device.type != "cuda":
        log(f"--cuda-graph-impl {g.impl.value} on {device.type}: no graphs; the capture-equivalent path (static "
            "buffers copied in and out, eager)")
    if plan.fsdp is not None:
        done.fsdp = shard_model(model, dims, plan.fsdp)
    return done


def build_decoder(config: ModelConfig, dims: ParallelDims | None = None, options: ModelOptions | None = None,
                  **kwargs: Any) -> MoEDecoder:
    """``MoEDecoder(config, dims, options, **kwargs)`` with ``options``' recompute, offload and FP8 choices applied
    (``apply_execution`` of ``ExecutionPlan(options)``): the model as it runs, for callers that build one directly
    (loaders, evaluation, tests). The trainer builds the bare model and applies its whole plan once the weights
    are in."""
    options = options or ModelOptions()
    model = MoEDecoder(config, dims, options, **kwargs)
    apply_execution(model, ExecutionPlan(options), dims)
    return model


__all__ = ["Execution", "ExecutionPlan", "apply_execution", "build_decoder"]
