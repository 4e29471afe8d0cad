"""Validation: the LM loss and perplexity of the model on held-out samples, at any layout.

    evaluator = Evaluator(trainer, valid_samples, logger)   # run.py builds it with --split / --valid-data-path
    trainer.fit(train_samples, logger, evaluator=evaluator) # evaluates every --eval-interval steps and at the end

One evaluation runs ``eval_iters`` global batches of the validation samples (always the same ones, see
``training.data.validation``) through the model in eval mode without gradients, split into micro-batches
and over data-parallel ranks exactly like a training step (pipeline parallelism: the forward-only
version of the run's schedule). The loss is the training loss' convention - the mean over micro-batches
of each micro-batch's token-mean LM loss (no MoE or MTP terms) - so it is the same at every layout.

What crosses ranks: the model's own forward collectives, the pipeline activations, and one world
all-reduce of the summed losses at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moefold.pipeline import DecoderStage, build_schedule, run_schedule

if TYPE_CHECKING:
    from moefold.training.data.sampler import Samples
    from moefold.training.observe.metrics import MetricsLogger
    from moefold.training.trainer import Trainer


@dataclass(frozen=True)
class EvalResult:
    """One evaluation (global values, identical on every rank)."""

    step: int
    loss_lm: float
    tokens: int

    @property
    def ppl(self) -> float:
        """Perplexity exp(loss) (inf when it overflows)."""
        return math.exp(self.loss_lm) if self.loss_lm < 700 else math.inf


@torch.no_grad()
def evaluate(trainer: Trainer, samples: Samples, eval_iters: int) -> EvalResult:
    """The validation LM loss of ``trainer.model`` on the first ``eval_iters`` global batches of ``samples``.
    Collective over the world."""
    from moefold.training.data import MicroBatchLoader

    t, dims = trainer.config.train, trainer.dims
    loader = iter(MicroBatchLoader(samples, t.micro_batch_size, dims.dp_rank, dims.dp))
    total = torch.zeros((), dtype=torch.float64, device=trainer.device)
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        for _ in range(eval_iters):
            batches = [trainer._split(next(loader)) for _ in range(trainer.num_micro)]
            total += _lm_loss_sum(trainer, batches)
    finally:
        trainer.model.train(was_training)
    if dims.world_size > 1:   # other pipeline stages add zeros; every tp x cp rank holds the same token means
        dist.all_reduce(total)
    loss = total.item() / (dims.tp * dims.cp * eval_iters * trainer.num_micro * dims.dp)
    return EvalResult(step=trainer.iteration, loss_lm=loss, tokens=eval_iters * t.global_batch_size * t.seq_length)


def _lm_loss_sum(trainer: Trainer, batches: list[dict[str, Any]]) -> torch.Tensor:
    """Sum over the micro-batches (``Trainer._split``'s) of their token-mean LM losses (0 on stages without the
    head)."""
    if trainer.dims.pp == 1:   # (with the batch-level overlap too: evaluation has no backward to overlap)
        return sum(trainer.model(b["input_ids"], b["labels"], b.get("loss_mask"), documents=b.get("documents"))
                   .lm_loss.double() for b in batches)
    dims, layout = trainer.dims, trainer.layout
    schedule = build_schedule(trainer.pipeline.name, dims.pp, trainer.num_micro, layout.vpp, forward_only=True)
    stage = DecoderStage(trainer.model, layout, dims.pp_rank)
    mbs = [{"index": m, **b} for m, b in enumerate(batches)]
    ids = batches[0]["input_ids"]
    run_schedule(stage, schedule, mbs, stage.loss_fn, dims.pp_group,
                 stage.activation_spec(ids.shape[0], ids.shape[1], trainer.device))
    zero = torch.zeros((), dtype=torch.float64, device=trainer.device)
    return sum((v.double() for v in stage.lm_losses.values()), zero)


class Evaluator:
    """Evaluates every ``eval_interval`` steps (and once at the end of the run) and logs the result."""

    def __init__(self, trainer: Trainer, samples: Samples, logger: MetricsLogger | None = None) -> None:
        self.trainer, self.samples, self.logger = trainer, samples, logger
        self.results: list[EvalResult] = []

    def due(self, step: int, last: int) -> bool:
        interval = self.trainer.config.train.eval_interval
        return step == last or (interval is not None and step % interval == 0)

    def __call__(self) -> EvalResult:
        result = evaluate(self.trainer, self.samples, self.trainer.config.train.eval_iters)
        self.results.append(result)
        if self.logger is not None:
            self.logger.log_validation(result.step, loss_lm=result.loss_lm, ppl=result.ppl, tokens=result.tokens)
        return result
