"""RouterConfig: how tokens choose experts, how load is balanced, and what happens at capacity.

Each field names the Megatron-LM flag it mirrors (the CLI uses those names). Fields marked
"moefold" have no Megatron flag. Validation sits next to each field in ``__post_init__`` and
names the offending value and what would be valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


# The router's modes, as enums whose values are the flags' words (so configs, YAML, JSON and checkpoints keep their
# spelling): RouterConfig converts its strings once, in __post_init__; the router compares the members.
class _Mode(StrEnum):
    @classmethod
    def _missing_(cls, value: object) -> StrEnum:
        raise ValueError(f"{cls.__name__} {value!r} is unknown; valid: {', '.join(cls)}")


class ScoreFunction(_Mode):
    """--moe-router-score-function (``moe.scoring.score_all``)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    SQRTSOFTPLUS = "sqrtsoftplus"


class RouterDtype(_Mode):
    """--moe-router-dtype: what the gating GEMM and the scores compute in."""

    FP32 = "fp32"
    FP64 = "fp64"


class DropPolicy(_Mode):
    """--moe-token-drop-policy: which copies a full expert drops (``moe.capacity``)."""

    PROBS = "probs"
    POSITION = "position"


class AuxLossCounts(_Mode):
    """Which token counts the balancing losses use: TOPK (Megatron-Core; the DeepSeek-V3 report's indicator): a
    fresh plain top-k of the scores, without the expert bias and the group limit; DISPATCHED: the routing the tokens
    are dispatched with (moefold's earlier convention: the loss then balances what the experts receive)."""

    TOPK = "topk"
    DISPATCHED = "dispatched"


SCORE_FUNCTIONS: tuple[str, ...] = tuple(f.value for f in ScoreFunction)
LOAD_BALANCING_TYPES: tuple[str, ...] = ("aux_loss", "seq_aux_loss", "global_aux_loss", "quantile_balancing", "none")
DROP_POLICIES: tuple[str, ...] = tuple(p.value for p in DropPolicy)
ROUTER_DTYPES: tuple[str, ...] = tuple(d.value for d in RouterDtype)
AUX_LOSS_COUNTS: tuple[str, ...] = tuple(c.value for c in AuxLossCounts)


def _err(msg: str) -> ValueError:
    return ValueError(f"RouterConfig: {msg}")


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _err(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class RouterConfig:
    """Top-k router of one MoE layer.

    ``load_balancing_type`` / ``aux_loss_coeff`` accept a single value or a tuple (Megatron
    accepts several types, each with its own coefficient); both are normalised to tuples of the
    same length (a single coefficient applies to every type).
    """

    num_experts: int                                  # --num-experts
    topk: int = 2                                     # --moe-router-topk
    score_function: ScoreFunction = ScoreFunction.SOFTMAX   # --moe-router-score-function (SCORE_FUNCTIONS)
    pre_softmax: bool = False                         # --moe-router-pre-softmax (softmax over all E, no renorm)
    # Renormalise the k selected probs to sum 1 (HF ``norm_topk_prob``; moefold). None: the
    # natural default: softmax post-top-k -> True (by definition), pre-softmax -> False,
    # sigmoid -> True when topk > 1 (DeepSeek-V3).
    norm_topk_prob: bool | None = None
    topk_scaling_factor: float | None = None          # --moe-router-topk-scaling-factor (DeepSeek-V3: 2.5)
    num_groups: int | None = None                     # --moe-router-num-groups (group-limited routing)
    group_topk: int | None = None                     # --moe-router-group-topk (groups kept per token)
    # Scores summed per group to rank groups (moefold). None: topk // group_topk (Megatron);
    # DeepSeek-V3 / HF DeepseekV3TopkRouter use a fixed 2 (= 8 // 4 for the real model).
    group_score_topk: int | None = None
    load_balancing_type: tuple[str, ...] | str = ("aux_loss",)  # --moe-router-load-balancing-type
    aux_loss_coeff: tuple[float, ...] | float = (0.0,)          # --moe-aux-loss-coeff (one per type)
    aux_loss_counts: AuxLossCounts = AuxLossCounts.TOPK   # --moe-aux-loss-counts (moefold): topk | dispatched
    z_loss_coeff: float | None = None                 # --moe-z-loss-coeff
    input_jitter_eps: float | None = None             # --moe-input-jitter-eps (training only)
    router_dtype: RouterDtype = RouterDtype.FP32      # --moe-router-dtype: fp32 | fp64 (gating GEMM + scores)
    enable_expert_bias: bool = False                  # --moe-router-enable-expert-bias (aux-loss-free)
    bias_update_rate: float = 1e-3                    # --moe-router-bias-update-rate
    bias_update_center: bool = False                  # moefold: subtract the mean of each bias update
    # --moe-router-quantile-balancing-ema: with load_balancing_type quantile_balancing, the bias kept from the
    # previous global batch (0: replaced by the latest quantile each step; moe.quantile_balancing)
    quantile_balancing_ema: float = 0.0
    expert_capacity_factor: float | None = None       # --moe-expert-capacity-factor (None: dropless)
    # --moe-expert-rank-capacity-factor: copies an expert-parallel rank receives, at most C x its share (the
    # dispatch group's copies / ep); copies are dropped only where a rank's load exceeds that (moe.capacity)
    expert_rank_capacity_factor: float | None = None
    token_drop_policy: DropPolicy = DropPolicy.PROBS  # --moe-token-drop-policy: probs | position
    pad_expert_input_to_capacity: bool = False        # --moe-pad-expert-input-to-capacity
    force_load_balancing: bool = False                # --moe-router-force-load-balancing (benchmarks)
    init_std: float = 0.02                            # --init-method-std (router weight)
    bias: bool = False                                # moefold: a learned bias on the gating logits (GPT-OSS)

    def __post_init__(self) -> None:
        _positive_int("num_experts", self.num_experts)
        _positive_int("topk", self.topk)
        if self.topk > self.num_experts:
            raise _err(f"topk={self.topk} exceeds num_experts={self.num_experts}; valid: 1..{self.num_experts}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise _err(f"score_function={self.score_function!r} is unknown; valid: {', '.join(SCORE_FUNCTIONS)}")
        object.__setattr__(self, "score_function", ScoreFunction(self.score_function))
        if self.pre_softmax and self.score_function is not ScoreFunction.SOFTMAX:
            raise _err(f"pre_softmax=True needs score_function='softmax', got {self.score_function.value!r}")
        if self.norm_topk_prob is False and self.score_function is ScoreFunction.SOFTMAX and not self.pre_softmax:
            raise _err("norm_topk_prob=False with post-top-k softmax (pre_softmax=False) is contradictory: "
                       "softmax over the k selected logits always sums to 1; use pre_softmax=True for "
                       "unnormalised probabilities (Qwen3 norm_topk_prob=False)")
        if self.topk_scaling_factor is not None and not self.topk_scaling_factor > 0:
            raise _err(f"topk_scaling_factor={self.topk_scaling_factor} must be > 0 (or None)")
        self._check_groups()
        self._check_balancing()
        if self.aux_loss_counts not in AUX_LOSS_COUNTS:
            raise _err(f"aux_loss_counts={self.aux_loss_counts!r} is unknown; valid: {', '.join(AUX_LOSS_COUNTS)}")
        object.__setattr__(self, "aux_loss_counts", AuxLossCounts(self.aux_loss_counts))
        if self.z_loss_coeff is not None and not self.z_loss_coeff >= 0:
            raise _err(f"z_loss_coeff={self.z_loss_coeff} must be >= 0 (or None)")
        if self.input_jitter_eps is not None and not 0 < self.input_jitter_eps < 1:
            raise _err(f"input_jitter_eps={self.input_jitter_eps} must be in (0, 1) (or None)")
        if self.router_dtype not in ROUTER_DTYPES:
            raise _err(f"router_dtype={self.router_dtype!r} is unknown; valid: {', '.join(ROUTER_DTYPES)}")
        object.__setattr__(self, "router_dtype", RouterDtype(self.router_dtype))
        if not self.bias_update_rate >= 0:
            raise _err(f"bias_update_rate={self.bias_update_rate} must be >= 0")
        self._check_capacity()
        if not self.init_std > 0:
            raise _err(f"init_std={self.init_std} must be > 0")

    def _check_groups(self) -> None:
        if (self.num_groups is None) != (self.group_topk is None):
            raise _err(f"num_groups={self.num_groups} and group_topk={self.group_topk} must be set together "
                       "(group-limited routing) or both left None")
        if self.num_groups is None:
            if self.group_score_topk is not None:
                raise _err(f"group_score_topk={self.group_score_topk} needs num_groups/group_topk")
            return
        _positive_int("num_groups", self.num_groups)
        _positive_int("group_topk", self.group_topk)
        if self.num_experts % self.num_groups:
            divisors = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise _err(f"num_groups={self.num_groups} does not divide num_experts={self.num_experts}; "
                       f"valid: {', '.join(map(str, divisors))}")
        if self.group_topk > self.num_groups:
            raise _err(f"group_topk={self.group_topk} exceeds num_groups={self.num_groups}; "
                       f"valid: 1..{self.num_groups}")
        per_group = self.num_experts // self.num_groups
        if self.topk > self.group_topk * per_group:
            raise _err(f"topk={self.topk} exceeds the {self.group_topk * per_group} experts of the "
                       f"group_topk={self.group_topk} kept groups ({per_group} experts each)")
        if self.group_score_topk is None and self.topk < self.group_topk:
            raise _err(f"topk={self.topk} < group_topk={self.group_topk}: the group score uses "
                       "topk // group_topk = 0 experts; set group_score_topk explicitly")
        gst = self.resolved_group_score_topk
        if not isinstance(gst, int) or not 1 <= gst <= per_group:
            raise _err(f"group_score_topk={gst} must be an integer in 1..{per_group} (experts per group)")

    def _check_balancing(self) -> None:
        types = (self.load_balancing_type,) if isinstance(self.load_balancing_type, str) \
            else tuple(self.load_balancing_type)
        coeffs = (self.aux_loss_coeff,) if isinstance(self.aux_loss_coeff, int | float) \
            else tuple(self.aux_loss_coeff)
        if not types:
            raise _err("load_balancing_type is empty; use 'none' for no balancing loss")
        for t in types:
            if t not in LOAD_BALANCING_TYPES:
                hint = " (sinkhorn routing is not implemented)" if t == "sinkhorn" else ""
                raise _err(f"load_balancing_type={t!r} is unknown{hint}; valid: {', '.join(LOAD_BALANCING_TYPES)}")
        if len(set(types)) != len(types):
            raise _err(f"load_balancing_type={types} repeats a type")
        for alone in ("none", "quantile_balancing"):
            if alone in types and len(types) > 1:
                raise _err(f"load_balancing_type={types}: {alone!r} cannot be combined with other types")
        if not 0.0 <= self.quantile_balancing_ema < 1.0:
            raise _err(f"quantile_balancing_ema={self.quantile_balancing_ema} must be in [0, 1)")
        if types == ("quantile_balancing",):
            # the bias alone balances the load (Megatron asserts the same): no group limit, no second bias
            for name, value, off in (("num_groups", self.num_groups, None), ("enable_expert_bias",
                                     self.enable_expert_bias, False), ("force_load_balancing",
                                     self.force_load_balancing, False)):
                if value != off:
                    raise _err(f"{name}={value!r} cannot be combined with load_balancing_type quantile_balancing "
                               f"(valid: {off!r}); the quantile bias is the only balancing")
        if len(coeffs) == 1:
            coeffs = coeffs * len(types)
        if len(coeffs) != len(types):
            raise _err(f"aux_loss_coeff={coeffs} has {len(coeffs)} values for {len(types)} load_balancing_type "
                       f"{types}; give one coefficient, or one per type")
        for c in coeffs:
            if not isinstance(c, int | float) or not c >= 0:
                raise _err(f"aux_loss_coeff={c!r} must be a number >= 0")
        object.__setattr__(self, "load_balancing_type", types)
        object.__setattr__(self, "aux_loss_coeff", tuple(float(c) for c in coeffs))

    def _check_capacity(self) -> None:
        if self.expert_capacity_factor is not None and not self.expert_capacity_factor > 0:
            raise _err(f"expert_capacity_factor={self.expert_capacity_factor} must be > 0 (or None: dropless)")
        if self.expert_rank_capacity_factor is not None and not self.expert_rank_capacity_factor > 0:
            raise _err(f"expert_rank_capacity_factor={self.expert_rank_capacity_factor} must be > 0 (or None: "
                       "dropless)")
        if self.token_drop_policy not in DROP_POLICIES:
            raise _err(f"token_drop_policy={self.token_drop_policy!r} is unknown; valid: {', '.join(DROP_POLICIES)}")
        object.__setattr__(self, "token_drop_policy", DropPolicy(self.token_drop_policy))
        if self.pad_expert_input_to_capacity and self.expert_capacity_factor is None:
            raise _err("pad_expert_input_to_capacity=True needs expert_capacity_factor (dropless has no capacity)")

    # -- resolved values ---------------------------------------------------------------------
    @property
    def resolved_norm_topk_prob(self) -> bool:
        if self.norm_topk_prob is not None:
            return self.norm_topk_prob
        if self.score_function is ScoreFunction.SOFTMAX:
            return not self.pre_softmax
        return self.topk > 1

    @property
    def resolved_group_score_topk(self) -> int | None:
        if self.num_groups is None:
            return None
        return self.group_score_topk if self.group_score_topk is not None else self.topk // self.group_topk

    def loss_coeffs(self) -> dict[str, float]:
        """{balancing loss type: coefficient} for the enabled losses (coefficient > 0)."""
        return {t: c for t, c in zip(self.load_balancing_type, self.aux_loss_coeff)
                if t not in ("none", "quantile_balancing") and c > 0}

    @property
    def quantile_balancing(self) -> bool:
        """Selection against the per-expert quantile bias (moe.quantile_balancing) instead of a loss."""
        return self.load_balancing_type == ("quantile_balancing",)
