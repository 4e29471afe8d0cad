"""One rank of a training run: layout, data, trainer, metrics, resume, checkpoints, load-balance report.

``train(config, device)`` is what every rank of ``moefold train`` calls (torch.distributed already
initialised when world > 1). Rank 0 logs; every rank trains.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moefold.parallel.dims import ParallelDims
from moefold.training.build import micro_batches
from moefold.training.config import RunConfig
from moefold.training.observe.flops import train_flops_per_token
from moefold.training.observe.memory import describe_static
from moefold.training.trainer import FitSummary, StepResult, Trainer

if TYPE_CHECKING:
    from moefold.training.data.sampler import Samples
    from moefold.training.launch.signals import StopRequest
    from moefold.training.launch.watchdog import Heartbeat


def build_dataset(config: RunConfig, dims: ParallelDims, part: str = "train") -> Samples:
    """The training samples (seq_length + 1 ids each) for the whole run: the ``--data-path`` blend, or the
    built-in corpus; ``part="valid"``: the validation samples (``--valid-data-path``, or the ``--split``
    validation documents of the same corpora). Rank 0 prepares/caches first; the others then read the caches."""
    from moefold.training.data import build_blended, builtin_corpus, parse_data_path
    from moefold.training.data.validation import split_cache_dir, split_corpora

    t = config.train
    num_samples = (t.train_iters if part == "train" else t.eval_iters) * t.global_batch_size
    if t.data_order == "megatron":
        return _synchronised(lambda: build_megatron_dataset(config, part), dims)

    def build() -> Samples:
        if part == "valid" and t.valid_data_path:
            prefixes, weights = parse_data_path(list(t.valid_data_path))
        elif t.data_path:
            prefixes, weights = parse_data_path(list(t.data_path))
        else:
            prefixes, weights = [builtin_corpus(t.vocab_size or config.model.vocab_size, cache_dir=t.data_cache_dir,
                                                progress=dims.rank == 0)], None
        cache_dir = None
        if t.split is not None:   # training and validation read disjoint document ranges of each corpus
            cache_dir = split_cache_dir(prefixes, t.split, part)
            prefixes = split_corpora(prefixes, t.split, part)
        ds = build_blended(prefixes, weights, t.seq_length, num_samples, seed=t.seed, cache_dir=cache_dir)
        if ds.vocab_size > config.model.vocab_size:
            raise ValueError(f"the data's vocabulary ({ds.vocab_size}) exceeds the model's vocab_size="
                             f"{config.model.vocab_size}; pass --vocab-size {ds.vocab_size} or a matching tokenizer")
        return ds

    return _synchronised(build, dims)


def _synchronised(build: Callable[[], Samples], dims: ParallelDims) -> Samples:
    """``build()`` on rank 0 first (it writes the index caches), then on the others (they read them)."""
    if dims.world_size == 1:
        return build()
    ds = build() if dims.rank == 0 else None
    dist.barrier()
    return ds if ds is not None else build()


def build_megatron_dataset(config: RunConfig, part: str = "train") -> Samples:
    """``--data-order megatron``: Megatron-Core's train or validation samples for this run
    (``training.data.megatron_order``): ``--data-path`` with ``--split``, or ``--data-path`` for training and
    ``--valid-data-path`` for validation (Megatron's per-split paths), sized as Megatron-LM sizes them."""
    from moefold.training.data.megatron_order import (
        MegatronBlend,
        build_megatron_datasets,
        num_samples_per_split,
        parse_blend,
    )

    t = config.train
    if not t.data_path:
        raise ValueError("--data-order megatron needs --data-path (Megatron's order of a corpus on disk)")
    sizes = num_samples_per_split(t.train_iters, t.global_batch_size, t.eval_iters, t.eval_interval)

    def frozen(items) -> tuple:
        prefixes, weights = parse_blend(list(items))
        return tuple(prefixes), tuple(weights) if weights is not None else None

    if t.valid_data_path:
        blend = MegatronBlend(blend_per_split=(frozen(t.data_path), frozen(t.valid_data_path), None))
    else:
        blend = MegatronBlend(blend=frozen(t.data_path), split=t.split or "969,30,1")
    cache = None if t.data_cache_dir is None else f"{t.data_cache_dir}/megatron"
    datasets = build_megatron_datasets(blend, sizes, t.seq_length, t.seed, t.mid_level_dataset_surplus, cache)
    ds = datasets[("train", "valid").index(part)]
    if ds is None:
        raise ValueError(f"--data-order megatron: --split {t.split} leaves no {part} data")
    if ds.vocab_size > config.model.vocab_size:
        raise ValueError(f"the data's largest token id {ds.vocab_size - 1} does not fit the model's vocab_size="
                         f"{config.model.vocab_size}")
    return ds


def save_run_assets(config: RunConfig) -> None:
    """``SAVE/hf_assets``: the tokenizer and generation config that the run's exports (``moefold convert``) and
    ``moefold generate`` use: those of ``--load-hf``, else the training data's tokenizer (its document
    separator as the end-of-sequence token)."""
    import json

    from moefold.models.hf.assets import RUN_ASSETS_DIR, copy_assets
    from moefold.training.data import eos_id

    t = config.train
    dst = Path(t.save) / RUN_ASSETS_DIR
    if t.load_hf:
        copy_assets(t.load_hf, dst)
        return
    tok = run_tokenizer(config)
    if tok is None:
        return
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id(tok)}, indent=2))


def run_tokenizer(config: RunConfig):
    """The training data's tokenizer (a HF ``tokenizers.Tokenizer``): Megatron's tokenizer flags, else the first
    corpus's ``PREFIX.tokenizer.json`` (the built-in corpus's without ``--data-path``); None when there is none."""
    from moefold.training.data import builtin_corpus, load_tokenizer, tokenizer_path

    t = config.train
    if t.tokenizer_type:   # Megatron's tokenizer flags name the run's tokenizer
        from moefold.training.data.megatron_tokenizer import megatron_tokenizer

        return megatron_tokenizer(t.tokenizer_type, t.tokenizer_model, t.vocab_file, t.merge_file)
    prefix = parse_blend_prefix(t.data_path) if t.data_path else \
        builtin_corpus(t.vocab_size or config.model.vocab_size, cache_dir=t.data_cache_dir, progress=False)
    return load_tokenizer(tokenizer_path(prefix)) if tokenizer_path(prefix).is_file() else None


def document_eod(config: RunConfig) -> int | None:
    """The end-of-document token id that packed samples are split at (``--reset-position-ids``,
    ``--reset-attention-mask``, ``--eod-mask-loss``: the tokenizer's document separator, Megatron's
    ``tokenizer.eod``), or None when none of them is set."""
    from moefold.training.data import eos_id

    if not config.train.data.packs_documents:
        return None
    tok = run_tokenizer(config)
    if tok is None:
        raise ValueError("--reset-position-ids / --reset-attention-mask / --eod-mask-loss split samples at the "
                         "tokenizer's end-of-document token: give --tokenizer-type, or a --data-path prepared by "
                         "`moefold prepare-data` (it writes PREFIX.tokenizer.json)")
    return eos_id(tok)


def parse_blend_prefix(items) -> str:
    """The first corpus of a ``--data-path`` (Megatron's syntax, weighted or not)."""
    from moefold.training.data.megatron_order import parse_blend

    return parse_blend(list(items))[0][0]


def train(config: RunConfig, device: torch.device | str = "cpu", heartbeat: Heartbeat | None = None,
          interactive: bool = False, on_step: Callable[[StepResult], None] | None = None,
          progress: bool = False) -> FitSummary:
    """Train ``config`` on this rank; returns what ``Trainer.fit`` did (identical on every rank). ``heartbeat``
    (from the launcher) learns each completed step. ``config.train.exit_signals`` stop the run after the current
    step with a checkpoint (``training.launch.signals``); ``interactive``: this process is the one the user
    started (world 1), so it notes a first Ctrl-C and stops at once on a second. ``on_step`` gets each step's
    result (the trainer keeps none); ``progress``: rank 0 draws a progress bar (the launcher decides: only on a
    terminal). With ``skip_train``, only validates the loaded (or initial) model: no step, no save."""
    from moefold.training.launch.signals import StopRequest, signal_numbers

    t = config.train
    if t.run_dir is None:
        raise ValueError("config.train.run_dir is not set (moefold train chooses it: training.launch.claim)")
    stop = StopRequest(signal_numbers(t.exit_signals), interactive=interactive,
                       note=interactive or (heartbeat is None and int(os.environ.get("RANK", "0")) == 0)
                       ) if t.exit_signals else None
    try:
        return _train(config, device, heartbeat, stop, on_step, progress)
    finally:
        if stop is not None:
            stop.restore()


def _train(config: RunConfig, device: torch.device | str, heartbeat: Heartbeat | None,
           stop: StopRequest | None, on_step: Callable[[StepResult], None] | None, progress: bool) -> FitSummary:
    t = config.train
    dims = ParallelDims.build(config.parallel, device_type=torch.device(device).type)
    is_log = dims.rank == 0
    from tqdm import tqdm

    say = tqdm.write if is_log else (lambda *_a, **_k: None)  # keeps the progress bar intact
    source = f"recipe {config.recipe}" if config.recipe else f"--load-hf {t.load_hf}" if t.load_hf else \
        f"--load-megatron {t.load_megatron}" if t.load_megatron else "model flags"
    say(f"moefold train: {source} ({config.model.name}), {dims.describe()}, device {device}")
    start = time.perf_counter()
    dataset = None if t.skip_train else build_dataset(config, dims)
    valid = build_dataset(config, dims, part="valid") if t.has_validation else None
    if t.save and is_log:
        save_run_assets(config)
    trainer = Trainer(config, dims, device=device, log=say, eod_token=document_eod(config))
    finished = False
    try:
        summary = _run(trainer, config, dims, device, heartbeat, stop, on_step, start, say, valid, dataset, progress)
        finished = True
        return summary
    finally:
        trainer.close(graceful=finished)   # after a failure a peer may be gone: release locally, wait for nothing


def _run(trainer: Trainer, config: RunConfig, dims: ParallelDims, device: torch.device | str,
         heartbeat: Heartbeat | None, stop: StopRequest | None, on_step: Callable[[StepResult], None] | None,
         start: float, say: Callable[..., None], valid: Samples | None, dataset: Samples | None,
         progress: bool) -> FitSummary:
    t = config.train
    is_log = dims.rank == 0
    trainer.stop_request = stop
    n_params = sum(p.numel() for p in trainer.model.parameters())
    say(f"model: {n_params / 1e6:.2f}M parameters on rank 0, {micro_batches(trainer.num_micro)} per step")
    if t.use_torch_fsdp2:
        from moefold.training.optim.fsdp import describe_fsdp

        say(f"rank 0 {describe_fsdp(trainer.sync, trainer.optimizer)}")
    else:
        say(f"rank 0 {describe_static(trainer.sync, trainer.optimizer, trainer.param_dtype, t.optimizer_precision())}")
    from moefold.training.observe.fp8_report import fp8_summary, fp8_tag

    if config.options.fp8.enabled or config.options.fp8.dispatch:
        say(fp8_summary(trainer.model, config.options.fp8))
    if t.load:
        trainer.load(t.load)
    if heartbeat is not None:
        heartbeat.beat(trainer.iteration)
    caller = on_step

    def on_step(r: StepResult) -> None:
        if heartbeat is not None:
            heartbeat.beat(r.step)
        if caller is not None:
            caller(r)

    logger = None
    if is_log:
        from moefold.training.observe.hardware import device_peak
        from moefold.training.observe.metrics import MetricsLogger

        dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
        peak = device_peak(device, dtype)
        logger = MetricsLogger(t.run_dir, total_steps=t.train_iters, start_step=trainer.iteration,
                               flops_per_token=train_flops_per_token(config.model, t.seq_length),
                               peak_flops_per_s=peak.flops_per_s * dims.world_size, peak_flops_source=peak.source,
                               device=device, config=config.to_dict(), progress=progress,
                               drop_later_steps=not t.skip_train,
                               wandb={"project": t.wandb_project, "name": t.wandb_exp_name, "dir": t.wandb_save_dir}
                               if t.wandb_project else None, fp8=fp8_tag(trainer.model, config.options.fp8))
    evaluator = None
    if valid is not None:
        from moefold.training.evaluate import Evaluator

        evaluator = Evaluator(trainer, valid, logger)
        if trainer.iteration == 0 or t.skip_train:   # where the run starts from: the baseline of a continued
            evaluator()                                 # pretraining, or all --skip-train does
    if t.skip_train:
        if logger is not None:
            logger.close()
        if is_log:
            v = evaluator.results[-1]
            say(f"validation only (--skip-train), the model at step {v.step}: lm loss {v.loss_lm:.4f}, perplexity "
                f"{v.ppl:.3f} ({v.tokens} tokens) in {time.perf_counter() - start:.1f}s")
            say(f"metrics: {Path(t.run_dir) / 'metrics.jsonl'}")
        return FitSummary(steps=0, first=None, last=None, stop=None, checkpoint=None)
    try:
        summary = trainer.fit(dataset, logger, on_step=on_step, evaluator=evaluator)
        trainer.finish_saves()   # (not after a failure: a background save's collectives may wait for a dead rank)
    finally:
        if logger is not None:
            logger.close()
    if is_log:
        if summary.steps:
            say(f"{'stopped' if summary.stop else 'done'}: {summary.steps} steps in "
                f"{time.perf_counter() - start:.1f}s, lm loss {summary.first.loss_lm:.4f} -> "
                f"{summary.last.loss_lm:.4f}")
        if evaluator is not None and evaluator.results:
            first, v = evaluator.results[0], evaluator.results[-1]
            say(f"validation: lm loss {first.loss_lm:.4f} (step {first.step}) -> {v.loss_lm:.4f} (step {v.step}), "
                f"perplexity {first.ppl:.3f} -> {v.ppl:.3f} ({v.tokens} tokens)")
        if t.balance_report and trainer.moe_layers and summary.stop is None:
            from moefold.training.observe.balance_report import report

            paths = report(t.run_dir)
            say(f"load-balance report: {', '.join(str(p) for p in paths)}")
        say(f"metrics: {Path(t.run_dir) / 'metrics.jsonl'}")
    return summary
