"""Run-time choices of how a model is computed (not what it computes): ``ModelOptions``.

The architecture is ``ModelConfig``; the layout is ``ParallelDims``; everything else that a run may
change without changing the model's mathematics lives here, so the same checkpoint can be trained
with a different dispatcher, recompute mode or CP exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moefold.dense.activation_offload import MIN_OFFLOADED_TENSOR_SIZE, check_offload, check_offload_modules
from moefold.dense.context_parallel import CP_COMM_MODES
from moefold.dense.gated_delta_rule import GATED_DELTA_RULE_BACKENDS
from moefold.dense.recompute import (
    DEFAULT_RECOMPUTE_MODULES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODES,
    check_recompute_modules,
)
from moefold.dispatch.config import DispatcherKind
from moefold.dispatch.flex_backend import FlexBackend
from moefold.moe.gemm import GemmBackend
from moefold.precision.fp8 import FP8Config

DEEPEP_MODES: tuple[str, ...] = ("hybrid", "direct")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelOptions:
    """How the decoder runs.

    sequence_parallel: shard activations along the sequence between TP regions (only matters at tp > 1)
    cp_comm:           context-parallel K/V exchange, one of ``CP_COMM_MODES``
    recompute:         Megatron's --recompute-granularity: "none" | "selective" | "full" (see ``dense.recompute``)
    recompute_modules: selective: the modules to recompute (``dense.recompute.RECOMPUTE_MODULES``)
    recompute_method:  full: "uniform" (groups of ``recompute_num_layers`` layers) | "block" (the first
                       ``recompute_num_layers`` layers of each pipeline chunk)
    recompute_num_layers: full: the N of ``recompute_method``
    dispatcher:        token dispatcher kind (``dispatch.config.DispatcherKind``'s values) or "auto": "local" when
                       ep*etp == 1, else "alltoall" (``resolved_dispatcher``)
    gemm_backend:      routed-expert GEMM backend (``moe.gemm.GemmBackend``)
    dtype:             parameter dtype, "fp32" | "bf16" | "fp16" (routers and expert bias stay fp32)
    init_std:          std of the normal init of every weight matrix
    fp8:               FP8 GEMMs and dispatch (``precision.fp8.FP8Config``; --fp8-format, --fp8-recipe,
                       --fp8-backend, --fp8-exclude-modules, --moe-fp8-dispatch)
    moe_deepep_num_sms: SMs DeepEP's kernels take with the flex dispatcher (--moe-deepep-num-sms; 0: DeepEP V2's
                       analytic count, the legacy backend's 20)
    moe_flex_dispatcher_backend: "auto" | "deepep" (DeepEP V2) | "deepep-legacy" (``dispatch.flex_backend.FlexBackend``)
    moe_deepep_mode:   DeepEP V2: "hybrid" (RDMA once per node, NVLink forwarding) | "direct"
    moe_deepep_cpu_sync: DeepEP V2: the host waits for the received counts (exact buffers) or not (None: on when
                       the expert GEMMs take host counts anyway)
    moe_deepep_max_tokens_per_rank: DeepEP V2's ``num_max_tokens_per_rank`` (0: the run's micro-batch x
                       sequence / (tp x cp), filled in by ``training.build.model_options``)
    offload_modules:   fine-grained activation offloading (--fine-grained-activation-offloading --offload-modules):
                       the modules whose saved tensors wait in host memory (``dense.activation_offload``); () = off
    min_offloaded_tensor_size: saved tensors with fewer elements stay on the device (--min-offloaded-tensor-size)
    linear_attention_backend: Gated DeltaNet kernel, "auto" | "torch" | "fla" (``dense.gated_delta_rule``)
    max_attention_logit: GQA layers record each head's largest attention logit (``--qk-clip``, MuonClip)
    """

    sequence_parallel: bool = True
    cp_comm: str = "p2p"
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    dispatcher: str = "auto"
    gemm_backend: GemmBackend = GemmBackend.GROUPED_MM
    dtype: str = "fp32"
    init_std: float = 0.02
    fp8: FP8Config = field(default_factory=FP8Config)
    moe_deepep_num_sms: int = 0
    moe_flex_dispatcher_backend: FlexBackend = FlexBackend.AUTO
    moe_deepep_mode: str = "hybrid"
    moe_deepep_cpu_sync: bool | None = None
    moe_deepep_max_tokens_per_rank: int = 0
    offload_modules: tuple[str, ...] = ()
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE
    linear_attention_backend: str = "auto"
    max_attention_logit: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.fp8, dict):  # from a saved RunConfig (JSON)
            object.__setattr__(self, "fp8", FP8Config(**self.fp8))
        if self.cp_comm not in CP_COMM_MODES:
            raise ValueError(f"ModelOptions.cp_comm={self.cp_comm!r} is not one of {CP_COMM_MODES}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"ModelOptions.recompute={self.recompute!r} is not one of {RECOMPUTE_MODES}")
        # a list after a JSON round trip (checkpoint meta): store the tuple the dataclass promises
        object.__setattr__(self, "recompute_modules", check_recompute_modules(self.recompute_modules))
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"--recompute-method={self.recompute_method!r}; valid: {', '.join(RECOMPUTE_METHODS)}")
        if (not isinstance(self.recompute_num_layers, int) or isinstance(self.recompute_num_layers, bool)
                or self.recompute_num_layers < 1):
            raise ValueError(f"--recompute-num-layers={self.recompute_num_layers!r} must be a positive integer")
        if self.dispatcher != "auto":   # the kinds are checked by DispatcherKind, "auto" is this field's own
            object.__setattr__(self, "dispatcher", DispatcherKind(self.dispatcher))
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
        object.__setattr__(self, "moe_flex_dispatcher_backend", FlexBackend(self.moe_flex_dispatcher_backend))
        if self.moe_deepep_mode not in DEEPEP_MODES:
            raise ValueError(f"--moe-deepep-mode={self.moe_deepep_mode!r}; valid: {', '.join(DEEPEP_MODES)}")
        if self.linear_attention_backend not in GATED_DELTA_RULE_BACKENDS:
            raise ValueError(f"ModelOptions.linear_attention_backend={self.linear_attention_backend!r}; valid: "
                             f"{', '.join(GATED_DELTA_RULE_BACKENDS)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolved_dispatcher(self, ep: int, etp: int) -> DispatcherKind:
        """The dispatcher kind for ep x etp ranks (``auto`` resolved)."""
        if self.dispatcher != "auto":
            return DispatcherKind(self.dispatcher)
        return DispatcherKind.LOCAL if ep * etp == 1 else DispatcherKind.ALLTOALL
