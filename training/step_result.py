"""What a training step and a run return: ``StepResult`` (one optimizer step, the same on every rank), ``FitSummary``
(what ``Trainer.fit`` did), and ``NonFiniteError`` (too many skipped steps in a row)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from moefold.training.launch.signals import Stop


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, global values (identical on every rank).

    loss_lm / loss_aux / loss_mtp: means over the step's micro-batches and dp ranks (aux: weighted
    shares summed over tp x cp; mtp: unweighted, None without MTP)
    tokens_per_expert: float64 [moe layers, E] selections of the step over all ranks (None without MoE)
    dropped: float64 [moe layers] dropped copies over all ranks
    router: float64 [moe layers, ROUTER_SUMS] per-layer router losses (means over the step's micro-batches and dp)
            and entropy / token sums over all ranks (``training.observe.expert_counts.router_layer_metrics``; None
            without MoE)
    max_load_ratio: the worst micro-batch's max/mean expert load over its dispatch group (with
            ``--moe-max-load-ratio``, ``training.observe.imbalance``; else None)
    received_per_expert: float64 [moe layers, E] copies each expert received over all ranks, as the dispatcher
            counted them (DeepEP V2's ``cumulative_local_expert_recv_stats``: after capacity drops); None where the
            dispatchers do not count
    """

    step: int
    loss_lm: float
    loss_aux: float
    loss_mtp: float | None
    grad_norm: float
    lr: float
    skipped: bool
    tokens: int
    tokens_per_expert: Tensor | None
    dropped: Tensor | None
    router: Tensor | None = None
    max_load_ratio: float | None = None
    received_per_expert: Tensor | None = None
    stop: Stop | None = None      # the ranks agreed to stop after this step (a signal, --exit-*)


@dataclass(frozen=True)
class FitSummary:
    """What ``Trainer.fit`` did: the steps it ran, the first and last step's results (per-step results go to
    ``on_step``; the trainer keeps no history), why it stopped early (None: it reached its last step) and the
    checkpoint it saved at the end (None: no ``save``)."""

    steps: int
    first: StepResult | None
    last: StepResult | None
    stop: Stop | None
    checkpoint: Path | None


__all__ = ["FitSummary", "NonFiniteError", "StepResult"]
