"""MoEConfig: what one MoE layer computes and with which backends (layout comes from ParallelDims)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moefold.dispatch.factory import DISPATCHER_KINDS
from moefold.dispatch.flex_backend import check_flex_backend
from moefold.moe.expert_rows import ROW_LAYOUTS
from moefold.moe.experts import ACTIVATIONS, GatedActivation
from moefold.moe.fp8_gemm import check_fp8_gemm_backend
from moefold.moe.gemm import GEMM_BACKENDS
from moefold.precision.fp8 import FP8Config

if TYPE_CHECKING:
    from moefold.moe.router_config import RouterConfig

DISPATCHERS: tuple[str, ...] = DISPATCHER_KINDS


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"MoEConfig: {name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer. Top-k, scoring, capacity and balancing live in ``router`` (RouterConfig).

    ``shared_expert_ffn_size`` is the FFN size of the *combined* shared experts (DeepSeek's
    ``n_shared_experts * moe_intermediate_size``, Qwen2-MoE's ``shared_expert_intermediate_size``,
    Megatron's ``moe_shared_expert_intermediate_size``); 0 means no shared experts.
    """

    num_experts: int
    moe_ffn_hidden_size: int                      # per routed expert (Megatron --moe-ffn-hidden-size)
    router: RouterConfig
    shared_expert_ffn_size: int = 0
    shared_expert_gate: bool = False              # Qwen2-MoE: y_shared *= sigmoid(x @ w_gate)
    activation: str = "swiglu"                    # "swiglu" (gated SiLU) | "gelu"
    dispatcher: str = "alltoall"                  # "local" | "allgather" | "alltoall" | "flex" (DeepEP)
    gemm_backend: str = "grouped_mm"              # see moe.gemm.GEMM_BACKENDS
    expert_row_layout: str = "auto"               # CPU row layout of the expert GEMMs (moe.expert_rows)
    init_std: float = 0.02
    output_init_std: float | None = None          # w2 / shared down projection; None = init_std
    fp8: FP8Config | None = None                  # FP8 expert GEMMs and FP8 dispatch (precision.fp8)
    deepep_num_sms: int = 0                       # flex: SMs DeepEP's kernels use (--moe-deepep-num-sms); 0: V2's
                                                  # get_theoretical_num_sms, legacy's 20 (Megatron's default)
    flex_backend: str = "auto"                    # flex: "deepep" (V2) | "deepep-legacy" | "auto" (the installed one)
    # flex on V2 (dispatch.deepep_elastic): the most tokens a rank routes per call (sizes DeepEP's buffer; the
    # trainer sets micro-batch x sequence / (tp x cp)), hybrid (NVLink-forwarded) or direct mode, and the CPU sync
    # for the received counts (None: on exactly when the expert GEMMs take host counts: te, grouped_gemm, loop, FP8)
    deepep_max_tokens_per_rank: int | None = None
    deepep_hybrid: bool = True
    deepep_cpu_sync: bool | None = None
    apply_probs_on_input: bool = False            # x * probs before the experts, top-1 only (Megatron's
                                                  # --moe-apply-probs-on-input); default: in the combine
    # GPT-OSS's experts: biases on both projections and the clamped SwiGLU (moe.experts.GatedActivation)
    linear_bias: bool = False                     # per-expert biases on w13 and w2 (HF *_proj_bias)
    swiglu_alpha: float = 1.0                     # act(g) = g * sigmoid(alpha * g); 1 = SiLU (GPT-OSS 1.702)
    activation_clamp: float | None = None         # Megatron --activation-func-clamp-value (GPT-OSS 7)
    glu_linear_offset: float = 0.0                # Megatron --glu-linear-offset: act(gate) * (up + offset) (GPT-OSS 1)

    def __post_init__(self) -> None:
        _positive("num_experts", self.num_experts)
        _positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        if not isinstance(self.shared_expert_ffn_size, int) or self.shared_expert_ffn_size < 0:
            raise ValueError(f"MoEConfig: shared_expert_ffn_size={self.shared_expert_ffn_size!r} must be an "
                             "integer >= 0 (0 = no shared experts)")
        if self.shared_expert_gate and self.shared_expert_ffn_size == 0:
            raise ValueError("MoEConfig: shared_expert_gate=True needs shared experts (shared_expert_ffn_size > 0)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig: activation={self.activation!r}; valid: {', '.join(ACTIVATIONS)}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"MoEConfig: dispatcher={self.dispatcher!r}; valid: {', '.join(DISPATCHERS)}")
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"MoEConfig: gemm_backend={self.gemm_backend!r}; valid: {', '.join(GEMM_BACKENDS)}")
        if self.expert_row_layout not in ROW_LAYOUTS:
            raise ValueError(f"MoEConfig: expert_row_layout={self.expert_row_layout!r}; valid: "
                             f"{', '.join(ROW_LAYOUTS)}")
        if not self.init_std > 0 or (self.output_init_std is not None and not self.output_init_std > 0):
            raise ValueError(f"MoEConfig: init_std={self.init_std} and output_init_std={self.output_init_std} "
                             "must be > 0")
        check_fp8_gemm_backend(self.fp8, self.gemm_backend)
        check_flex_backend(self.flex_backend)
        legacy = self.dispatcher == "flex" and self.flex_backend == "deepep-legacy"
        if self.fp8 is not None and self.fp8.dispatch and legacy:
            raise ValueError("MoEConfig: FP8 dispatch (--moe-fp8-dispatch) runs with the alltoall and allgather "
                             "dispatchers and flex on DeepEP V2 (--moe-flex-dispatcher-backend deepep), not on "
                             "deepep-legacy")
        if legacy and (not self.deepep_hybrid or self.deepep_cpu_sync is False):
            raise ValueError("MoEConfig: --moe-deepep-mode direct and sync-free dispatch (--no-moe-deepep-cpu-sync) "
                             "are DeepEP V2 settings (--moe-flex-dispatcher-backend deepep), not deepep-legacy's")
        sms = self.deepep_num_sms
        if not isinstance(sms, int) or isinstance(sms, bool) or sms < 0 or sms == 1 or sms % 2:
            raise ValueError(f"MoEConfig: deepep_num_sms={sms!r} must be an even integer >= 2, or 0 for the "
                             "backend's choice (--moe-deepep-num-sms; DeepEP runs two SMs per channel)")
        tokens = self.deepep_max_tokens_per_rank
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
            raise ValueError(f"MoEConfig: deepep_max_tokens_per_rank={tokens!r} must be a positive integer or None")
        router_experts = getattr(self.router, "num_experts", self.num_experts)
        if router_experts != self.num_experts:
            raise ValueError(f"MoEConfig: num_experts={self.num_experts} but router.num_experts={router_experts}")
        topk = getattr(self.router, "topk", 1)
        if self.apply_probs_on_input and topk != 1:
            raise ValueError(f"MoEConfig: apply_probs_on_input (--moe-apply-probs-on-input) needs router topk=1, got "
                             f"topk={topk}: with k > 1 each copy of a token has its own weight, which the "
                             f"combine applies (the default)")
        if topk > self.num_experts:
            raise ValueError(f"MoEConfig: router topk={topk} exceeds num_experts={self.num_experts}")
        glu_set = (self.swiglu_alpha, self.activation_clamp, self.glu_linear_offset) != (1.0, None, 0.0)
        if glu_set and self.activation != "swiglu":
            raise ValueError(f"MoEConfig: swiglu_alpha / activation_clamp / glu_linear_offset shape the gated "
                             f"activation; activation={self.activation!r} is not gated")
        GatedActivation(self.swiglu_alpha, self.activation_clamp, self.glu_linear_offset)   # checks the values
        if self.linear_bias and self.gemm_backend == "te":
            raise ValueError("MoEConfig: expert biases (linear_bias, GPT-OSS) run with gemm backends grouped_mm, "
                             "loop or grouped_gemm, not 'te' (its GroupedLinear runs both GEMMs in one call)")

    @property
    def glu(self) -> GatedActivation:
        return GatedActivation(self.swiglu_alpha, self.activation_clamp, self.glu_linear_offset)

    @property
    def has_shared_experts(self) -> bool:
        return self.shared_expert_ffn_size > 0

    def check_layout(self, *, tp: int, ep: int, etp: int) -> None:
        """Layout-dependent checks, naming the numbers (called when the layer is built)."""
        if self.num_experts % ep:
            raise ValueError(f"MoEConfig: num_experts={self.num_experts} is not divisible by ep={ep}")
        if self.moe_ffn_hidden_size % etp:
            raise ValueError(f"MoEConfig: moe_ffn_hidden_size={self.moe_ffn_hidden_size} is not divisible "
                             f"by etp={etp}")
        if self.shared_expert_ffn_size % tp:
            raise ValueError(f"MoEConfig: shared_expert_ffn_size={self.shared_expert_ffn_size} is not "
                             f"divisible by tp={tp} (shared experts are tensor-parallel like the dense MLP)")
        if self.dispatcher == "local" and ep * etp > 1:
            raise ValueError(f"MoEConfig: dispatcher='local' needs ep*etp=1, got ep={ep} etp={etp}; "
                             "use 'allgather' or 'alltoall'")
