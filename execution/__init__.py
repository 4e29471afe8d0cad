"""moefold.execution: the cross-cutting features, applied to a built model in one pass (TorchTitan's
``parallelize``): recompute, activation offload, FP8 linears, split backward, gradient-accumulation fusion, compile,
CUDA graphs, FSDP2. Layers: ``models < execution < pipeline``; it may import parallel, precision, dense, dispatch,
moe, models.

Design: extension points low, implementations here
----------------------------------------------------
A layer cannot import this package (it sits above every layer), and no feature sets a layer's attribute from
outside. So each layer owns named, typed *extension points* defined with it, whose defaults do nothing extra, and
uses them in its forward; this package implements the concrete ones and installs them through a method the layer
defines, which checks the names and kinds:

- **regions** (``dense.regions``): ``Region`` (``region(fn, *args)``) and ``OutputRegion`` (``region.open()``,
  ``.run(fn, *args)``, ``.consumed(consumer_output)``: the part's output may be freed once its consumer saved it).
  ``TransformerBlock.regions`` = ``body, attn_norm, mlp_norm, ffn``; ``GQAAttention`` = ``qkv_linear, core_attn,
  attn_proj``; ``MLAttention`` those and ``up_proj``; ``GatedDeltaNet`` = ``core_attn``; ``MoELayer`` =
  ``shared_experts``; ``GroupedExperts`` = ``expert_fc1, moe_act``; installed with ``layer.configure(name=region)``
  (``dense.regions.replace_regions``: ValueError for an unknown name or kind).
  Defaults: ``PLAIN`` / ``KEEP_OUTPUT``, or ``CHECKPOINT`` where the layer's own ``recompute`` argument asks.
- **the decoder's layer run** (``models.decoder.LayerRun``): ``groups(layer_ids)`` (full recompute's checkpointed
  groups), ``begin_chunk()`` / ``end_chunk(hidden)`` (offloading's chunks); ``MoEDecoder.configure(layers=...)``.
  The pipeline's overlap schedules read the same groups.
- **GEMM strategies** (``dense.linear.LocalGemm``): any callable with ``F.linear``'s signature;
  ``ColumnParallelLinear/RowParallelLinear.configure(gemm=...)``. The routed experts' three strategies, each an
  object: ``GroupedExperts.configure(gemm=...)`` (an ``ExpertGemm``: its split-backward form),
  ``weight_grads=WeightGrads.MAIN_GRAD`` (fusion) and ``activation_kernel=COMPILED_ACTIVATION`` (``--compile``).
  The autograd-level pieces every splitting or fusing GEMM shares stay below the layers (``dense.split_backward``:
  the store and ``weight_inputs``; ``dense.grad_accumulation``: the main-grad slots), because the experts' GEMMs
  use them too.

Implementations, one module per feature, in the order ``apply_execution`` runs them (``execution.apply``):

=========================== =========================================================================
``recompute``               ``CHECKPOINT`` / ``DISCARD_OUTPUT`` regions, ``FullRecompute`` (layer run)
``offloader``               the offload mechanism: ``ActivationOffloader``, ``OffloadRegion`` (both kinds)
``activation_offload``      which regions offload; ``OffloadedChunks`` (layer run)
``fp8_linear``              ``Float8LinearGemm`` and ``convert_linears_to_fp8`` (TE and block-scaled GEMMs
                            from ``precision``)
``split_backward``          ``SplitLinearGemm``, ``install_weight_grad_store``
``grad_accumulation``       ``fused_linear``, ``enable_grad_accumulation_fusion``
``compile``                 ``compile_model`` (per block, MoE-aware)
``graph_capture``           the scopes' flattened calls and static-buffer run (``StaticRun``)
``cuda_graph``              ``--cuda-graph-impl local|transformer_engine``: ``apply_cuda_graphs``, refusals
``step_graph``              ``--cuda-graph-impl full_iteration``: ``StepGraph``
``fsdp``                    ``shard_model`` (``fully_shard`` unit by unit)
``apply``                   ``ExecutionPlan``, ``apply_execution``, ``Execution`` (what it did)
=========================== =========================================================================
"""

from moefold.execution.activation_offload import OffloadedChunks, apply_activation_offload, offloaded_parts
from moefold.execution.apply import Execution, ExecutionPlan, apply_execution, build_decoder
from moefold.execution.compile import CompileReport, compile_model, compile_moe_layer, compile_unavailable
from moefold.execution.cuda_graph import CudaGraphImpl, CudaGraphPlan, CudaGraphScope, apply_cuda_graphs
from moefold.execution.fp8_linear import Float8LinearGemm, convert_linears_to_fp8, fp8_linear_names
from moefold.execution.fsdp import FSDPPlan, FSDPSharding, fsdp_units, shard_model
from moefold.execution.grad_accumulation import enable_grad_accumulation_fusion, fused_linear
from moefold.execution.offloader import ActivationOffloader, OffloadRegion, host_allocation, is_host_allocation
from moefold.execution.recompute import DISCARD_OUTPUT, FullRecompute, apply_recompute, full_recompute_groups
from moefold.execution.split_backward import SplitLinearGemm, install_weight_grad_store, split_local_gemm
from moefold.execution.step_graph import StepGraph

__all__ = [
    "ActivationOffloader", "CompileReport", "CudaGraphImpl", "CudaGraphPlan", "CudaGraphScope", "DISCARD_OUTPUT",
    "Execution", "ExecutionPlan", "FSDPPlan", "FSDPSharding", "Float8LinearGemm", "FullRecompute", "OffloadRegion",
    "OffloadedChunks", "SplitLinearGemm", "StepGraph", "apply_activation_offload", "apply_cuda_graphs",
    "apply_execution", "apply_recompute", "build_decoder", "compile_model", "compile_moe_layer", "compile_unavailable",
    "convert_linears_to_fp8", "enable_grad_accumulation_fusion", "fp8_linear_names", "fsdp_units",
    "full_recompute_groups", "fused_linear", "host_allocation", "install_weight_grad_store", "is_host_allocation",
    "offloaded_parts", "shard_model", "split_local_gemm",
]
