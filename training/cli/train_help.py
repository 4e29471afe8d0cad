"""The help text of ``moefold train``'s router flags (the training flags' is their ``TrainConfig`` fields'
(``training.sections``); the others carry theirs where they are added)."""

from __future__ import annotations

from moefold.moe.router_config import DROP_POLICIES, LOAD_BALANCING_TYPES, ROUTER_DTYPES, SCORE_FUNCTIONS

# help text and choices of the router flags (unset: the recipe's / --load-hf model's value)
ROUTER_HELP: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "--moe-router-score-function": ("router scores: softmax (Qwen3, Mixtral) or sigmoid (DeepSeek-V3)",
                                    SCORE_FUNCTIONS),
    "--moe-router-pre-softmax": ("softmax over all experts before the top-k (off: over the k selected)", None),
    "--moe-router-topk-scaling-factor": ("scale of the selected probabilities (DeepSeek-V3: 2.5)", None),
    "--moe-router-num-groups": ("expert groups of group-limited routing (DeepSeek-V3: 8)", None),
    "--moe-router-group-topk": ("groups a token may route to (DeepSeek-V3: 4)", None),
    "--moe-router-load-balancing-type": ("the balancing loss --moe-aux-loss-coeff weighs: per micro-batch, per "
                                         "sequence, over the global batch, or none", LOAD_BALANCING_TYPES),
    "--moe-z-loss-coeff": ("router z-loss coefficient (ST-MoE); unset: off", None),
    "--moe-input-jitter-eps": ("training only: multiply router inputs by uniform noise in [1-eps, 1+eps]", None),
    "--moe-router-dtype": ("precision of the gating GEMM and scores", ROUTER_DTYPES),
    "--moe-router-enable-expert-bias": ("aux-loss-free balancing: a per-expert selection bias updated after each "
                                        "step (DeepSeek-V3)", None),
    "--moe-router-bias-update-rate": ("the expert bias's step per update (--moe-router-enable-expert-bias)", None),
    "--moe-expert-capacity-factor": ("expert capacity as a multiple of the balanced load; copies over it are "
                                     "dropped (unset: dropless)", None),
    "--moe-expert-rank-capacity-factor": ("Megatron's per-rank budget: an expert-parallel rank receives at most C "
                                          "x its share of the copies; only above it are copies dropped (unset: "
                                          "dropless)", None),
    "--moe-token-drop-policy": ("which copies a full expert drops: the lowest probabilities or the latest "
                                "positions", DROP_POLICIES),
    "--moe-pad-expert-input-to-capacity": ("pad each expert's input to its capacity: static shapes, no host sync "
                                           "(needs --moe-expert-capacity-factor)", None),
    "--moe-router-force-load-balancing": ("benchmarks only: route by random logits (balanced loads)", None),
    "--moe-apply-probs-on-input": ("top-1: scale the token by its probability before the expert (off: the "
                                   "expert's output, in the combine)", None),
}
