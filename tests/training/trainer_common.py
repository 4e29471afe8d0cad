"""Shared pieces of the trainer tests: a tiny run config, fixed random data, a run to completion."""

from __future__ import annotations

import numpy as np
import torch

from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, named_full_params, shards_of
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.observe.metrics import MetricsLogger
from moefold.training.trainer import Trainer

SEQ = 32
RECIPE = "deepseek_v3_tiny"   # MLA, MTP, expert bias, shared experts, seq aux loss: the most features


def tiny_config(parallel: ParallelConfig = ParallelConfig(), steps: int = 5, recipe: str = RECIPE,
                model: dict | None = None, **train) -> RunConfig:
    """``recipe`` with 2 layers and a 256-token vocabulary (then ``model`` overrides), trained ``steps`` steps."""
    model_config = get_recipe(recipe).with_(**{"num_layers": 2, "vocab_size": 256, **(model or {})})
    t = dict(micro_batch_size=1, global_batch_size=4, seq_length=SEQ, train_iters=steps, lr=3e-3, min_lr=3e-4,
             lr_warmup_iters=1, weight_decay=0.1, clip_grad=1.0, seed=7, log_interval=1, bucket_numel=4096)
    t.update(train)
    return RunConfig(model=model_config, parallel=parallel, options=ModelOptions(), train=TrainConfig(**t),
                     recipe=recipe)


def tiny_data(num_samples: int = 64, vocab: int = 256) -> np.ndarray:
    """Random but learnable samples: repeated short patterns, so the loss falls in a few steps."""
    rng = np.random.default_rng(0)
    out = np.empty((num_samples, SEQ + 1), dtype=np.int64)
    for i in range(num_samples):
        pattern = rng.integers(0, vocab, size=rng.integers(3, 7))
        out[i] = np.resize(pattern, SEQ + 1)
    return out


def fit_results(trainer: Trainer, data, **kwargs) -> list:
    """``trainer.fit``'s step results, collected through ``on_step`` (the trainer keeps none itself)."""
    results: list = []
    trainer.fit(data, on_step=results.append, **kwargs)
    return results


def tiny_corpus(prefix, num_samples: int = 64) -> str:
    """``tiny_data(num_samples)`` written as an indexed corpus at ``prefix`` (vocab 256), one sample a document."""
    from moefold.training.data.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(prefix, 256) as writer:
        for row in tiny_data(num_samples):
            writer.add_document(row)
    return str(prefix)


def run(config: RunConfig, dims: ParallelDims | None = None, data: np.ndarray | None = None,
        load: str | None = None, hook=None, stop_at: int | None = None, log=None, run_dir: str | None = None,
        setup=None, eod: int | None = None) -> tuple[list[float], dict[str, torch.Tensor], Trainer]:
    """Train ``config`` (optionally resuming from ``load``, stopping after ``stop_at`` steps); returns
    (lm losses of the steps run, full params and ``buffer:``-prefixed buffers such as expert biases, trainer).
    With ``run_dir``, rank 0 writes the metrics JSONL there (``training.observe.metrics.read_metrics`` reads it).
    ``setup(trainer)`` runs before training (e.g. to observe the trainer's steps); ``eod``: the end-of-document token
    of packed samples (``--reset-position-ids`` ...)."""
    dims = dims or ParallelDims.single()
    trainer = Trainer(config, dims, log=log or (lambda _m: None), eod_token=eod)
    if load:
        trainer.load(load)
    if setup is not None:
        setup(trainer)
    trainer.loss_hook = hook
    logger = None
    if run_dir is not None and dims.rank == 0:
        logger = MetricsLogger(run_dir, total_steps=config.train.train_iters, tensorboard=False, progress=False,
                               print_fn=lambda _line: None)
    losses: list[float] = []
    try:
        trainer.fit(tiny_data() if data is None else data, logger=logger, stop_at=stop_at,
                    on_step=lambda r: losses.append(r.loss_lm))
    finally:
        if logger is not None:
            logger.close()
    params = named_full_params(trainer.model)
    params.update({f"buffer:{k}": v.float() for k, v in trainer.model.state_dict().items() if k not in params})
    return losses, params, trainer


def observe(trainer, record: dict) -> None:
    """Record, through the trainer's own objects, each step's reduced gradients as ``GradSync.finish`` leaves
    them (gathered to full shape) and the gradient norm the step clips with; and the initial parameters."""
    params = dict(trainer.model.named_parameters())
    record.update(initial=named_full_params(trainer.model), grads=[], norms=[], lrs=[])
    finish, grad_norm, step = trainer.sync.finish, trainer.optimizer.grad_norm, trainer.optimizer.step

    def finish_and_record() -> None:
        finish()
        reduced = trainer.sync.gathered_grads()
        record["grads"].append({n: gather_full(g, shards_of(params[n])).float() for n, g in reduced.items()})

    def grad_norm_and_record():
        norm = grad_norm()
        record["norms"].append(float(norm))
        return norm

    def step_and_record(lr: float, clip_coef: float = 1.0) -> None:
        record["lrs"].append((lr, clip_coef))
        step(lr, clip_coef)

    trainer.sync.finish, trainer.optimizer.grad_norm, trainer.optimizer.step = (
        finish_and_record, grad_norm_and_record, step_and_record)
