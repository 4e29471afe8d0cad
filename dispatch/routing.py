"""The router's decision for one micro-batch, as consumed by every token dispatcher (made by ``moe.router``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Routing:
    """Which experts see each of this rank's T tokens, and with what weight.

    probs_TK:            [T, K] fp32 combine weights (zero for a dropped copy)
    expert_ids_TK:       [T, K] int64 global expert ids in [0, num_experts)
    tokens_per_expert_E: [E] int64, kept copies of *this rank's* tokens per expert
    keep_TK:             [T, K] bool, False for copies dropped by capacity; None when dropless
    capacity:            per-expert capacity for this rank's tokens (None when dropless)
    pad_to_capacity:     dispatch every expert's chunk padded to exactly ``capacity`` rows
    pad_multiple:        dropless: lay each expert's rows out padded (zero rows) to a multiple of this
                         (``--moe-router-padding-for-quantization``: the FP8/FP4 grouped GEMMs' alignment)
    """

    probs_TK: Tensor
    expert_ids_TK: Tensor
    tokens_per_expert_E: Tensor
    keep_TK: Tensor | None = None
    capacity: int | None = None
    pad_to_capacity: bool = False
    pad_multiple: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.probs_TK.shape[0]

    @property
    def topk(self) -> int:
        return self.probs_TK.shape[1]

    @property
    def num_experts(self) -> int:
        return self.tokens_per_expert_E.shape[0]
