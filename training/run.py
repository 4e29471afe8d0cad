"""One rank of a training run: layout, data, trainer, metrics, resume, checkpoints, load-balance report.

``train(config, device)`` is what every rank of ``moefold train`` calls (torch.distributed already
initialised when world > 1). Rank 0 logs; every rank trains.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moefold.parallel.dims import ParallelDims
from moefold.training.config import RunConfig
from moefold.training.flops import train_flops_per_token
from moefold.training.trainer import StepResult, Trainer

if TYPE_CHECKING:
    from moefold.training.data.sampler import Samples


def build_dataset(config: RunConfig, dims: ParallelDims) -> Samples:
    """The training samples (seq_length + 1 ids each) for the whole run: the ``--data-path`` blend, or the
    built-in corpus. Rank 0 prepares/caches first; the others then read the caches."""
    from moefold.training.data import build_blended, builtin_corpus, parse_data_path

    t = config.train
    num_samples = t.train_iters * t.global_batch_size

    def build() -> Samples:
        if t.data_path:
            prefixes, weights = parse_data_path(list(t.data_path))
        else:
            prefixes, weights = [builtin_corpus(t.vocab_size or config.model.vocab_size, cache_dir=t.data_cache_dir,
                                                progress=dims.rank == 0)], None
        ds = build_blended(prefixes, weights, t.seq_length, num_samples, seed=t.seed)
        if ds.vocab_size > config.model.vocab_size:
            raise ValueError(f"the data's vocabulary ({ds.vocab_size}) exceeds the model's vocab_size="
                             f"{config.model.vocab_size}; pass --vocab-size {ds.vocab_size} or a matching tokenizer")
        return ds

    if dims.world_size == 1:
        return build()
    ds = build() if dims.rank == 0 else None
    dist.barrier()
    return ds if ds is not None else build()


def train(config: RunConfig, device: torch.device | str = "cpu") -> list[StepResult]:
    """Train ``config`` on this rank; returns the step results (identical on every rank)."""
    t = config.train
    dims = ParallelDims.build(config.parallel, device_type=torch.device(device).type)
    is_log = dims.rank == 0
    from tqdm import tqdm

    say = tqdm.write if is_log else (lambda *_a, **_k: None)  # keeps the progress bar intact
    say(f"moefold train: recipe {config.recipe} ({config.model.name}), {dims.describe()}, device {device}")
    start = time.perf_counter()
    dataset = build_dataset(config, dims)
    trainer = Trainer(config, dims, device=device, log=say)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    say(f"model: {n_params / 1e6:.2f}M parameters on rank 0, {trainer.num_micro} micro-batches per step, "
        f"optimizer state {trainer.optimizer.state_bytes() / 2**20:.1f} MiB on rank 0 (ZeRO-1)")
    from moefold.training.fp8_report import fp8_summary, fp8_tag

    if config.options.fp8.enabled or config.options.fp8.dispatch:
        say(fp8_summary(trainer.model, config.options.fp8))
    if t.load:
        trainer.load(t.load)
    logger = None
    if is_log:
        from moefold.training.metrics import MetricsLogger
        from moefold.training.metrics_hw import peak_flops

        dtype = torch.bfloat16 if t.bf16 else torch.float32
        logger = MetricsLogger(t.run_dir, total_steps=t.train_iters, start_step=trainer.iteration,
                               flops_per_token=train_flops_per_token(config.model, t.seq_length),
                               peak_flops_per_s=peak_flops(device, dtype) * dims.world_size, device=device,
                               config=config.to_dict(), fp8=fp8_tag(trainer.model, config.options.fp8))
    try:
        results = trainer.fit(dataset, logger)
    finally:
        if logger is not None:
            logger.close()
    if is_log:
        if results:
            say(f"done: {len(results)} steps in {time.perf_counter() - start:.1f}s, lm loss "
                f"{results[0].loss_lm:.4f} -> {results[-1].loss_lm:.4f}")
        if t.balance_report and trainer.moe_layers:
            from moefold.training.balance_report import report

            paths = report(t.run_dir)
            say(f"load-balance report: {', '.join(str(p) for p in paths)}")
        say(f"metrics: {Path(t.run_dir) / 'metrics.jsonl'}")
    return results
