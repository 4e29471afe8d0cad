"""``MoEConfig``: one MoE layer, composed of its parts' configs; each value is checked once, in the one that owns it.

    MoEConfig(num_experts, router=RouterConfig(...), experts=ExpertsConfig(...), dispatch=DispatchConfig(...),
              shared=SharedExpertsConfig(...) | None, apply_probs_on_input=False)

``RouterConfig`` (``moe.router_config``): top-k, scoring, capacity and balancing. ``ExpertsConfig``: the routed
experts (FFN size, activation, GEMM backend, biases, CPU row layout, init, FP8 GEMMs). ``DispatchConfig``
(``dispatch.config``): the token dispatcher and its options. ``SharedExpertsConfig``: the shared experts.
``MoEConfig`` checks what spans them (the router's expert count, the FP8 router padding's dispatch). Layout comes
from ``ParallelDims`` (``check_layout``). ``moe.build.build_moe_layer`` turns a config into a layer.

Choices are enums whose values are the flags' strings (``GemmBackend``, ``ExpertActivation``, ``RowLayout``,
``DispatcherKind``, ``FlexBackend``): a string given to a config (a flag, a YAML file, a saved config) becomes
its enum here; the code below reads the enums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moefold.dispatch.config import DispatchConfig, DispatcherKind
from moefold.moe.activation import ExpertActivation, GatedActivation
from moefold.moe.cpu.expert_rows import RowLayout
from moefold.moe.fp8_gemm import check_fp8_gemm_backend
from moefold.moe.gemm import GemmBackend
from moefold.moe.router_config import RouterConfig
from moefold.precision.fp8 import FP8Config


def _positive(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {name}={value!r} must be a positive integer")


def _check_stds(owner: str, init_std: float, output_init_std: float | None) -> None:
    if not init_std > 0 or (output_init_std is not None and not output_init_std > 0):
        raise ValueError(f"{owner}: init_std={init_std} and output_init_std={output_init_std} must be > 0")


@dataclass(frozen=True)
class ExpertsConfig:
    """The routed experts of one MoE layer (``moe.experts.GroupedExperts``).

    ffn_hidden_size: per expert (Megatron ``--moe-ffn-hidden-size``)
    activation:      gated SiLU (``swiglu``) or ``gelu``; ``glu`` parameterises the gated one (GPT-OSS's clamped
                     SwiGLU: ``--activation-func-clamp-value``, ``--glu-linear-offset``)
    gemm_backend:    ``--moe-grouped-gemm-backend`` (``moe.gemm.GemmBackend``)
    bias:            per-expert biases on both projections (GPT-OSS, HF ``*_proj_bias``)
    row_layout:      the CPU row layout of the grouped GEMMs (``moe.cpu.expert_rows.RowLayout``)
    init_std / output_init_std: the weights' normal init (w2: ``output_init_std``, None: ``init_std``)
    fp8:             FP8 / FP4 GEMMs (``precision.fp8.FP8Config``; off when None or not enabled)
    """

    ffn_hidden_size: int
    activation: ExpertActivation = ExpertActivation.SWIGLU
    glu: GatedActivation = field(default_factory=GatedActivation)
    gemm_backend: GemmBackend = GemmBackend.GROUPED_MM
    bias: bool = False
    row_layout: RowLayout = RowLayout.AUTO
    init_std: float = 0.02
    output_init_std: float | None = None
    fp8: FP8Config | None = None

    def __post_init__(self) -> None:
        _positive("ExpertsConfig", "ffn_hidden_size", self.ffn_hidden_size)
        object.__setattr__(self, "activation", ExpertActivation(self.activation))
        object.__setattr__(self, "gemm_backend", GemmBackend(self.gemm_backend))
        object.__setattr__(self, "row_layout", RowLayout(self.row_layout))
        _check_stds("ExpertsConfig", self.init_std, self.output_init_std)
        if not self.glu.is_swiglu and self.activation is not ExpertActivation.SWIGLU:
            raise ValueError(f"ExpertsConfig: swiglu_alpha / activation_clamp / glu_linear_offset ({self.glu}) shape "
                             f"the gated activation; activation='{self.activation}' is not gated")
        if self.bias and self.gemm_backend is GemmBackend.TE:
            raise ValueError("ExpertsConfig: expert biases (linear_bias, GPT-OSS) run with gemm backends grouped_mm, "
                             "loop or grouped_gemm, not 'te' (the biases are added between its two TE GEMMs)")
        check_fp8_gemm_backend(self.fp8, self.gemm_backend)

    @property
    def fp8_gemms(self) -> FP8Config | None:
        """The FP8 config when the expert GEMMs run in FP8 / FP4, else None."""
        return self.fp8 if self.fp8 is not None and self.fp8.enabled else None

    @property
    def reads_host_counts(self) -> bool:
        """The expert GEMMs read the counts on the host anyway (``te``, ``grouped_gemm``, ``loop``; FP8 GEMMs'
        per-expert weight gradients): what V2's flex dispatcher's ``cpu_sync=None`` follows."""
        return self.gemm_backend.needs_host_counts or self.fp8_gemms is not None


@dataclass(frozen=True)
class SharedExpertsConfig:
    """The shared experts (``moe.shared_experts.SharedExperts``): ``ffn_size`` of the *combined* shared experts
    (DeepSeek's ``n_shared_experts * moe_intermediate_size``, Qwen2-MoE's ``shared_expert_intermediate_size``,
    Megatron's ``moe_shared_expert_intermediate_size``); ``gate``: Qwen2-MoE's ``y *= sigmoid(x @ w_gate)``;
    ``clamp``: DeepSeek-V4's ``swiglu_limit`` (gate clamped to ``<= clamp``, up to ``[-clamp, clamp]``), or None.
    ``activation``: SwiGLU, or Nemotron-H's ungated squared ReLU (``relu2``), as the routed experts'."""

    ffn_size: int
    gate: bool = False
    init_std: float = 0.02
    output_init_std: float | None = None
    clamp: float | None = None
    activation: ExpertActivation = ExpertActivation.SWIGLU

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation", ExpertActivation(self.activation))
        if self.activation is ExpertActivation.GELU:
            raise ValueError("SharedExpertsConfig: activation='gelu' has no shared-expert form; use "
                             f"'{ExpertActivation.SWIGLU}' or '{ExpertActivation.RELU2}'")
        if self.clamp is not None and not self.clamp > 0:
            raise ValueError(f"SharedExpertsConfig: clamp={self.clamp!r} must be > 0 (or None)")
        if self.clamp is not None and self.activation is not ExpertActivation.SWIGLU:
            raise ValueError(f"SharedExpertsConfig: clamp={self.clamp!r} clamps SwiGLU's gate and up; "
                             f"activation='{self.activation}' has no gate")
        if self.gate and self.ffn_size == 0:
            raise ValueError("SharedExpertsConfig: shared_expert_gate=True needs shared experts "
                             "(shared_expert_ffn_size > 0)")
        _positive("SharedExpertsConfig", "ffn_size", self.ffn_size)
        _check_stds("SharedExpertsConfig", self.init_std, self.output_init_std)


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer (module docstring). ``apply_probs_on_input``: x * probs before the experts, top-1 only
    (Megatron's ``--moe-apply-probs-on-input``); default: in the combine."""

    num_experts: int
    router: RouterConfig
    experts: ExpertsConfig
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    shared: SharedExpertsConfig | None = None
    apply_probs_on_input: bool = False
    latent_size: int | None = None   # --moe-latent-size: experts and exchange at this width (moe.latent)

    def __post_init__(self) -> None:
        _positive("MoEConfig", "num_experts", self.num_experts)
        if self.latent_size is not None:
            _positive("MoEConfig", "latent_size", self.latent_size)
        if self.router.num_experts != self.num_experts:
            raise ValueError(f"MoEConfig: num_experts={self.num_experts} but router.num_experts="
                             f"{self.router.num_experts}")
        if self.apply_probs_on_input and self.router.topk != 1:
            raise ValueError(f"MoEConfig: apply_probs_on_input (--moe-apply-probs-on-input) needs router topk=1, got "
                             f"topk={self.router.topk}: with k > 1 each copy of a token has its own weight, which the "
                             f"combine applies (the default)")
        if self.pad_multiple is not None:
            if self.router.expert_capacity_factor is not None:
                raise ValueError("--moe-router-padding-for-quantization pads dropless routing; with "
                                 "--moe-expert-capacity-factor pad to capacity instead "
                                 "(--moe-pad-expert-input-to-capacity)")
            if self.dispatch.kind is DispatcherKind.FLEX:
                raise ValueError("--moe-router-padding-for-quantization is laid out by the allgather / alltoall "
                                 "dispatchers' row maps; the flex (DeepEP) dispatcher does not take it")

    @property
    def pad_multiple(self) -> int | None:
        """The rows each expert's block is padded to (``--moe-router-padding-for-quantization``), or None."""
        fp8 = self.experts.fp8
        return fp8.align_size if fp8 is not None and fp8.router_padding else None

    def check_layout(self, *, tp: int, ep: int, etp: int) -> None:
        """Layout-dependent checks, naming the numbers (called when the layer is built)."""
        if self.num_experts % ep:
            raise ValueError(f"MoEConfig: num_experts={self.num_experts} is not divisible by ep={ep}")
        if self.experts.ffn_hidden_size % etp:
            raise ValueError(f"MoEConfig: moe_ffn_hidden_size={self.experts.ffn_hidden_size} is not divisible "
                             f"by etp={etp}")
        if self.shared is not None and self.shared.ffn_size % tp:
            raise ValueError(f"MoEConfig: shared_expert_ffn_size={self.shared.ffn_size} is not divisible by tp={tp} "
                             "(shared experts are tensor-parallel like the dense MLP)")
        self.dispatch.check_layout(ep, etp)


__all__ = ["ExpertsConfig", "MoEConfig", "SharedExpertsConfig"]
