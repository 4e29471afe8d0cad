"""Shared pieces of the trainer tests: a tiny run config, fixed random data, a run to completion."""

from __future__ import annotations

import numpy as np
import torch

from models.options import ModelOptions
from models.recipes import get_recipe
from parallel.dims import ParallelConfig, ParallelDims
from training.config import RunConfig, TrainConfig
from training.trainer import Trainer, named_full_params

SEQ = 32
RECIPE = "deepseek_v3_tiny"   # MLA, MTP, expert bias, shared experts, seq aux loss: the most features


def tiny_config(parallel: ParallelConfig = ParallelConfig(), steps: int = 5, **train) -> RunConfig:
    model = get_recipe(RECIPE).with_(num_layers=2, vocab_size=256)
    t = dict(micro_batch_size=1, global_batch_size=4, seq_length=SEQ, train_iters=steps, lr=3e-3, min_lr=3e-4,
             lr_warmup_iters=1, weight_decay=0.1, clip_grad=1.0, seed=7, log_interval=1, bucket_numel=4096)
    t.update(train)
    return RunConfig(model=model, parallel=parallel, options=ModelOptions(), train=TrainConfig(**t), recipe=RECIPE)


def tiny_data(num_samples: int = 64, vocab: int = 256) -> np.ndarray:
    """Random but learnable samples: repeated short patterns, so the loss falls in a few steps."""
    rng = np.random.default_rng(0)
    out = np.empty((num_samples, SEQ + 1), dtype=np.int64)
    for i in range(num_samples):
        pattern = rng.integers(0, vocab, size=rng.integers(3, 7))
        out[i] = np.resize(pattern, SEQ + 1)
    return out


def run(config: RunConfig, dims: ParallelDims | None = None, data: np.ndarray | None = None,
        load: str | None = None, hook=None, stop_at: int | None = None, log=None,
        ) -> tuple[list[float], dict[str, torch.Tensor], Trainer]:
    """Train ``config`` (optionally resuming from ``load``, stopping after ``stop_at`` steps); returns
    (lm losses of the steps run, full params and ``buffer:``-prefixed buffers such as expert biases, trainer)."""
    dims = dims or ParallelDims.single()
    trainer = Trainer(config, dims, log=log or (lambda _m: None))
    if load:
        trainer.load(load)
    trainer.loss_hook = hook
    results = trainer.fit(tiny_data() if data is None else data, stop_at=stop_at)
    params = named_full_params(trainer.model)
    params.update({f"buffer:{k}": v.float() for k, v in trainer.model.state_dict().items() if k not in params})
    return [r.loss_lm for r in results], params, trainer
