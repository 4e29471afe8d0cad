"""The steps between two metrics records, summed for the next record: ``Trainer.fit`` adds every step's result
(``training.trainer.StepResult``: global values, identical on every rank) and, at each ``--log-interval`` step, the
last step and an early stop, writes one record through the ``MetricsLogger`` from the window's sums.

Summed over the window: tokens, each MoE layer's selections, dropped copies, router sums (per-step means,
``router_layer_metrics`` divides by the steps) and received copies; the worst micro-batch's expert-load max/mean
(``training.observe.imbalance``) is the window's maximum. Losses, grad norm and lr are the record's step's own.
Host values only: nothing crosses ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from moefold.training.observe.expert_counts import router_layer_metrics
from moefold.training.observe.metrics import MetricsLogger

if TYPE_CHECKING:
    from torch import Tensor

    from moefold.models.config import ModelConfig
    from moefold.training.step_result import StepResult


class LogWindow:
    """The sums of the steps ``add``-ed since the last ``clear`` (``model``: the run's ``ModelConfig``; ``moe_layers``:
    the global indices of its MoE layers, the rows of the per-layer sums; ``max_load_ratio``: the plan's
    ``--moe-max-load-ratio``, logged next to the observed one)."""

    def __init__(self, model: ModelConfig, moe_layers: Sequence[int], max_load_ratio: float | None) -> None:
        self.model, self.moe_layers, self.max_load_ratio = model, list(moe_layers), max_load_ratio
        self.clear()

    def clear(self) -> None:
        self.tokens = 0
        self.loads: Tensor | None = None      # float64 [moe layers, E] selections
        self.dropped: Tensor | None = None    # float64 [moe layers] dropped copies
        self.router: Tensor | None = None     # float64 [moe layers, ROUTER_SUMS] per-step router sums
        self.router_steps = 0
        self.received: Tensor | None = None   # float64 [moe layers, E] copies received, as the dispatcher counted
        self.load_ratio: float | None = None  # the worst micro-batch's expert load max/mean (imbalance watch)

    def add(self, r: StepResult) -> None:
        self.tokens += r.tokens
        if r.max_load_ratio is not None:
            self.load_ratio = max(self.load_ratio or 0.0, r.max_load_ratio)
        if r.tokens_per_expert is not None:
            self.loads = r.tokens_per_expert if self.loads is None else self.loads + r.tokens_per_expert
            self.dropped = r.dropped if self.dropped is None else self.dropped + r.dropped
            self.router = r.router if self.router is None else self.router + r.router
            self.router_steps += 1
        if r.received_per_expert is not None:
            self.received = r.received_per_expert if self.received is None else self.received + r.received_per_expert

    def log(self, logger: MetricsLogger, r: StepResult) -> None:
        """One record at step ``r`` (the window's last step) through ``logger``."""
        loads, received = self.loads, self.received
        routed = loads.sum(dim=1).clamp(min=1) if loads is not None else None
        # loss_mtp weighted as in the objective, so the logged "loss" is what is minimised
        mtp = None if r.loss_mtp is None else r.loss_mtp * self.model.mtp_loss_scaling_factor
        logger.log(r.step, loss_lm=r.loss_lm, loss_aux=r.loss_aux if self.moe_layers else None,
                   loss_mtp=mtp, extra={"loss_mtp_unweighted": r.loss_mtp} if mtp is not None else None,
                   grad_norm=r.grad_norm, lr=r.lr, tokens=self.tokens,
                   tokens_per_expert=loads.round().long().tolist() if loads is not None else None,
                   dropped_fraction=(self.dropped / routed).tolist() if loads is not None else None,
                   moe_layers=self.moe_layers if loads is not None else None, skipped=r.skipped,
                   router=router_layer_metrics(self.router, self.router_steps, self.model)
                   if self.router is not None else None,
                   received_per_expert=received.round().long().tolist() if received is not None else None,
                   load_ratio=None if self.load_ratio is None else (self.load_ratio, self.max_load_ratio))
