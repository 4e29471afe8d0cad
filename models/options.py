"""Run-time choices of how a model is computed (not what it computes): ``ModelOptions``.

The architecture is ``ModelConfig``; the layout is ``ParallelDims``; everything else that a run may
change without changing the model's mathematics lives here, so the same checkpoint can be trained
with a different dispatcher, recompute mode or CP exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moefold.dense.choices import (
    CP_COMM_MODES,
    DEFAULT_RECOMPUTE_MODULES,
    GATED_DELTA_RULE_BACKENDS,
    MAMBA_BACKENDS,
    MIN_OFFLOADED_TENSOR_SIZE,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODES,
    RECOMPUTE_MODULES,
    CPComm,
    DeltaRuleBackend,
    MambaBackend,
    Recompute,
    RecomputeMethod,
    check_offload,
    check_offload_modules,
    check_recompute_modules,
)
from moefold.dispatch.config import (
    AUTO,
    DEEPEP_MODES,
    DispatchConfig,
    DispatcherKind,
    deepep_hybrid,
    deepep_mode,
    dispatcher_kind,
)
from moefold.dispatch.flex_backend import FlexBackend
from moefold.models.composed import composed
from moefold.models.flag_field import flag
from moefold.moe.gemm_backend import GemmBackend
from moefold.precision.fp8 import FP8Config

# parameter dtype name -> torch's name for it (torch itself is imported when a model is built, not to check options)
DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
AUTO_DISPATCHER = AUTO   # --moe-token-dispatcher-type's word for DispatchConfig.kind None: by the layout

if TYPE_CHECKING:
    import torch


def _same(value: object) -> object:
    return value


def auto_dispatch() -> DispatchConfig:
    """``ModelOptions.dispatch``'s default: the dispatcher the layout chooses (``--moe-token-dispatcher-type auto``)."""
    return DispatchConfig(kind=None)


# the flex dispatcher's options by their flag names (ModelOptions' earlier flat fields, still read and written by
# saved configs and YAML files): (section, field, to it, from it)
FLEX_FLAGS = {
    "moe_flex_dispatcher_backend": ("dispatch", "flex.backend", FlexBackend, _same),
    "moe_deepep_num_sms": ("dispatch", "flex.num_sms", _same, _same),
    "moe_deepep_mode": ("dispatch", "flex.hybrid", deepep_hybrid, deepep_mode),
    "moe_deepep_cpu_sync": ("dispatch", "flex.cpu_sync", _same, _same),
    "moe_deepep_max_tokens_per_rank": ("dispatch", "flex.max_tokens_per_rank", lambda n: n or None,
                                       lambda n: n or 0),
}
# ModelOptions' earlier fields ``dispatcher`` (the kind; "auto" or None: by the layout) and ``flex`` (FlexOptions),
# now ``dispatch.kind`` and ``dispatch.flex``: still taken, read and (``dispatcher``) saved by those names
DISPATCH_ALIASES = {"dispatcher": ("dispatch", "kind", dispatcher_kind, _same),
                    "flex": ("dispatch", "flex", _same, _same), **FLEX_FLAGS}


@composed(sections=(), aliases=DISPATCH_ALIASES)
@dataclass(frozen=True)
class ModelOptions:
    """How the decoder runs. A field made with ``flag`` is the flag of ``moefold train`` its metadata names (its help,
    default and choices; ``training.cli.option_flags``), and so are the flex options' fields.

    sequence_parallel: shard activations along the sequence between TP regions (only matters at tp > 1)
    cp_comm:           context-parallel K/V exchange, one of ``CP_COMM_MODES``
    recompute:         Megatron's --recompute-granularity: "none" | "selective" | "full" (see ``dense.recompute``)
    recompute_modules: selective: the modules to recompute (``dense.recompute.RECOMPUTE_MODULES``)
    recompute_method:  full: "uniform" (groups of ``recompute_num_layers`` layers) | "block" (the first
                       ``recompute_num_layers`` layers of each pipeline chunk)
    recompute_num_layers: full: the N of ``recompute_method``
    dispatch:          what the MoE layers' dispatcher needs (``dispatch.config.DispatchConfig``), handed to it
                       unchanged: ``kind`` (--moe-token-dispatcher-type; None, "auto" as the flag and saved configs
                       spell it: "local" when ep*etp == 1, else "alltoall", chosen where the dispatcher is built),
                       ``flex`` (the flex dispatcher's ``FlexOptions``); its ``fp8`` stays False: FP8 dispatch is
                       ``fp8.dispatch`` (--moe-fp8-dispatch), put in by ``models.layer_factory.moe_config``, where
                       the combination is checked (DeepEP legacy refuses it). Also given and read by the
                       earlier flat names ``dispatcher`` (the kind), ``flex`` and the flex options' flag names:
                       moe_flex_dispatcher_backend (``FlexBackend``),
                       moe_deepep_num_sms (0: DeepEP V2's analytic count, legacy's 20), moe_deepep_mode ("hybrid":
                       RDMA once per node, NVLink forwarding | "direct"), moe_deepep_cpu_sync (None: on when the expert
                       GEMMs take host counts anyway), moe_deepep_max_tokens_per_rank (0: the run's micro-batch x
                       sequence / (tp x cp), filled in by ``training.build.model_options``)
    gemm_backend:      routed-expert GEMM backend (``moe.gemm.GemmBackend``)
    dtype:             parameter dtype, "fp32" | "bf16" | "fp16" (routers and expert bias stay fp32)
    init_std:          std of the normal init of every weight matrix
    fp8:               FP8 GEMMs and dispatch (``precision.fp8.FP8Config``; --fp8-format, --fp8-recipe,
                       --fp8-backend, --fp8-exclude-modules, --moe-fp8-dispatch)
    offload_modules:   fine-grained activation offloading (--fine-grained-activation-offloading --offload-modules):
                       the modules whose saved tensors wait in host memory (``dense.activation_offload``); () = off
    min_offloaded_tensor_size: saved tensors with fewer elements stay on the device (--min-offloaded-tensor-size)
    linear_attention_backend: Gated DeltaNet kernel, "auto" | "torch" | "fla" (``dense.gated_delta_rule``)
    mamba_backend: Mamba-2's scan and convolution, "torch" | "mamba_ssm" (``dense.mamba2_kernels``)
    max_attention_logit: GQA layers record each head's largest attention logit (``--qk-clip``, MuonClip)
    """

    sequence_parallel: bool = flag(True, "shard activations along the sequence between TP regions (tp > 1 only; "
                                   "--seq-length must then divide by tp)", action="optional")
    cp_comm: CPComm = flag("p2p", "context-parallel K/V exchange: p2p (ring, overlapped) or all_gather",
                        choices=CP_COMM_MODES, name="--cp-comm-type")
    recompute: Recompute = flag(
        Recompute.NONE, "activation recomputation: selective (--recompute-modules) or full (whole layers)",
        choices=RECOMPUTE_MODES, name="--recompute-granularity")
    recompute_modules: tuple[str, ...] = flag(
        DEFAULT_RECOMPUTE_MODULES, f"selective: any of {', '.join(RECOMPUTE_MODULES)} (default core_attn)",
        choices=RECOMPUTE_MODULES, nargs="+", metavar="MODULE")
    recompute_method: RecomputeMethod = flag(
        RecomputeMethod.UNIFORM, "full: uniform (groups of N layers) or block (the first N layers of each pipeline "
        "chunk)", choices=RECOMPUTE_METHODS)
    recompute_num_layers: int = flag(1, "full: the N of --recompute-method (default 1)")
    gemm_backend: GemmBackend = flag(
        GemmBackend.GROUPED_MM, "the experts' GEMMs: torch's grouped_mm, a per-expert loop, grouped_gemm or "
        "Transformer Engine (te) on CUDA", choices=tuple(b.value for b in GemmBackend),
        name="--moe-grouped-gemm-backend")
    dtype: str = "fp32"   # from --bf16 / --fp16 (TrainConfig's)
    init_std: float = flag(0.02, "standard deviation of the weights' normal initialisation", name="--init-method-std")
    fp8: FP8Config = field(default_factory=FP8Config)   # training.cli.fp8_flags
    dispatch: DispatchConfig = field(default_factory=auto_dispatch)   # its fields carry their flags (dispatch.config)
    offload_modules: tuple[str, ...] = ()   # two flags: --fine-grained-activation-offloading --offload-modules
    min_offloaded_tensor_size: int = flag(
        MIN_OFFLOADED_TENSOR_SIZE,
        f"saved tensors with fewer elements stay on the device (default {MIN_OFFLOADED_TENSOR_SIZE})")
    linear_attention_backend: DeltaRuleBackend = flag(
        DeltaRuleBackend.AUTO, "Gated DeltaNet kernel (Qwen3-Next's linear_attention layers): torch (chunked, any "
        "device), fla (flash-linear-attention, CUDA), auto (fla on CUDA when installed)",
        choices=GATED_DELTA_RULE_BACKENDS)
    mamba_backend: MambaBackend = flag(
        MambaBackend.TORCH, "Mamba-2 kernels (Nemotron-H's mamba layers): torch (chunked SSD scan, any device) or "
        "mamba_ssm (mamba-ssm + causal-conv1d, CUDA)", choices=MAMBA_BACKENDS)
    max_attention_logit: bool = False   # set by the trainer for --qk-clip

    def __post_init__(self) -> None:
        if isinstance(self.fp8, dict):  # from a saved RunConfig (JSON)
            object.__setattr__(self, "fp8", FP8Config(**self.fp8))
        if self.dispatch.fp8:   # one place for the switch: the layer's DispatchConfig takes it from fp8.dispatch
            raise ValueError("ModelOptions.dispatch.fp8=True: FP8 dispatch is fp8.dispatch (--moe-fp8-dispatch, "
                             "FP8Config(dispatch=True)); leave dispatch.fp8 False")
        if self.cp_comm not in CP_COMM_MODES:
            raise ValueError(f"ModelOptions.cp_comm={self.cp_comm!r} is not one of {CP_COMM_MODES}")
        object.__setattr__(self, "cp_comm", CPComm(self.cp_comm))
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"ModelOptions.recompute={self.recompute!r} is not one of {RECOMPUTE_MODES}")
        object.__setattr__(self, "recompute", Recompute(self.recompute))   # the layers compare the enum
        # a list after a JSON round trip (checkpoint meta): store the tuple the dataclass promises
        object.__setattr__(self, "recompute_modules", check_recompute_modules(self.recompute_modules))
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"--recompute-method={self.recompute_method!r}; valid: {', '.join(RECOMPUTE_METHODS)}")
        object.__setattr__(self, "recompute_method", RecomputeMethod(self.recompute_method))
        if (not isinstance(self.recompute_num_layers, int) or isinstance(self.recompute_num_layers, bool)
                or self.recompute_num_layers < 1):
            raise ValueError(f"--recompute-num-layers={self.recompute_num_layers!r} must be a positive integer")
        object.__setattr__(self, "gemm_backend", GemmBackend(self.gemm_backend))
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelOptions.dtype={self.dtype!r}; valid: {', '.join(DTYPES)}")
        object.__setattr__(self, "offload_modules", check_offload_modules(self.offload_modules))
        check_offload(self.offload_modules, self.recompute, self.recompute_modules)
        if (not isinstance(self.min_offloaded_tensor_size, int) or isinstance(self.min_offloaded_tensor_size, bool)
                or self.min_offloaded_tensor_size < 0):
            raise ValueError(f"--min-offloaded-tensor-size={self.min_offloaded_tensor_size!r} must be an integer >= 0")
        if not self.init_std > 0:
            raise ValueError(f"ModelOptions.init_std={self.init_std!r} must be > 0")
        if self.linear_attention_backend not in GATED_DELTA_RULE_BACKENDS:
            raise ValueError(f"ModelOptions.linear_attention_backend={self.linear_attention_backend!r}; valid: "
                             f"{', '.join(GATED_DELTA_RULE_BACKENDS)}")
        object.__setattr__(self, "linear_attention_backend", DeltaRuleBackend(self.linear_attention_backend))
        object.__setattr__(self, "mamba_backend", MambaBackend(self.mamba_backend))

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.dtype])

    def resolved_dispatcher(self, ep: int, etp: int) -> DispatcherKind:
        """The dispatcher kind for ep x etp ranks (None, ``auto``, resolved: the rule the dispatcher's builder uses)."""
        return self.dispatch.kind_for(ep, etp)


__all__ = ["AUTO_DISPATCHER", "DEEPEP_MODES", "DISPATCH_ALIASES", "DTYPES", "FLEX_FLAGS", "ModelOptions",
           "auto_dispatch"]
