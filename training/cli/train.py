"""``moefold train --recipe NAME``: pretrain an MoE recipe, with Megatron-LM's flag names.

    moefold train --recipe qwen3_moe_tiny                          # built-in corpus, CPU, world 1
    moefold train --recipe qwen3_moe_tiny --nproc 4 --expert-model-parallel-size 2
    moefold train --recipe qwen3_moe_tiny --hidden-size 256 --num-experts 16   # model flags (training.cli.model_flags)
    moefold train --load-hf Qwen3-30B-A3B --data-path corpus/x ...  # continued pretraining from an HF directory
    moefold train --load-hf Qwen3-8B --moe-use-upcycling --num-experts 8 --moe-router-topk 2 --data-path ...
    torchrun --nnodes 2 --nproc-per-node 8 -m training.cli train --recipe ... (multi-node)

The flags are defined in ``training.cli.train_flags``; here they become a ``RunConfig`` (``config_from_args``)
and the run starts (``main``, ``train_worker`` on every rank).

The flags are validated against the layout (``RunConfig.resolve(world)``, ``training.cli.train_checks``) and
the file system (``training.launch.preflight``: save/run directories, free space, --load, data files) in the
parent process before any rank starts; an impossible combination fails naming the flags. A failure inside a
rank ends the run with one ``rank R: <message>`` line and the tracebacks in ``RUN_DIR/error.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch

from moefold.dense.activation_offload import OFFLOAD_MODULES
from moefold.models.config import ModelConfig
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig
from moefold.parallel.init import launched_by_torchrun, launched_world_size
from moefold.training.cli.config_file import write_effective_config
from moefold.training.cli.fp8_flags import fp8_config_from_args
from moefold.training.cli.layout_errors import world_source
from moefold.training.cli.megatron_flags import megatron_model, tokenizer_vocab
from moefold.training.cli.model_flags import (
    UPCYCLING_FLAGS,
    apply_model_flags,
    apply_router_flags,
    given_model_flags,
)
from moefold.training.cli.option_flags import options_from_args
from moefold.training.cli.parser import Parser
from moefold.training.cli.train_checks import check_backends as check_backends
from moefold.training.cli.train_checks import resolve_flex, validate
from moefold.training.cli.train_checks import validate_layout as validate_layout
from moefold.training.cli.train_flags import add_arguments
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.errors import JobFailed
from moefold.training.launch.allocator import tune_cpu_allocator
from moefold.training.launch.claim import claim_run
from moefold.training.launch.preflight import preflight
from moefold.training.launch.ranks import run_ranks
from moefold.training.launch.signals import Stop, signal_numbers, stop_line
from moefold.training.launch.torchrun import agree, first_error, join_torchrun
from moefold.training.launch.watchdog import Heartbeat, watch_parent
from moefold.training.observe.machine import bf16_slower_notice, describe_machine

TAKES_CONFIG_FILE = True   # --config FILE: flags from YAML (training.cli.config_file)


def offload_modules_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--offload-modules, checked against --fine-grained-activation-offloading (ValueError naming them)."""
    if args.fine_grained_activation_offloading and not args.offload_modules:
        raise ValueError("--fine-grained-activation-offloading needs --offload-modules (any of "
                         f"{', '.join(OFFLOAD_MODULES)})")
    if args.offload_modules and not args.fine_grained_activation_offloading:
        raise ValueError(f"--offload-modules {' '.join(args.offload_modules)} needs "
                         "--fine-grained-activation-offloading")
    return tuple(args.offload_modules or ())


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    """The architecture: ``--recipe`` changed by the model flags, or ``--load-hf``'s (upcycled with
    ``--moe-use-upcycling``). ValueError naming the flags for a combination that cannot be."""
    given = given_model_flags(args)
    arch_router = given_model_flags(args, model=False)   # router flags that change what the model computes
    if args.load_megatron is not None:
        if args.load_hf is not None:
            raise ValueError("give either --load-hf or --load-megatron (the starting weights), not both")
        model = megatron_model(args)
        if model is not None:
            refused = ([f"--recipe {args.recipe}"] if args.recipe else []) + given + arch_router \
                + (["--vocab-size"] if args.vocab_size else []) + (["--model-json"] if args.model_json else [])
            if refused:
                raise ValueError(f"{' '.join(refused)} cannot be combined with --load-megatron {args.load_megatron}: "
                                 "the architecture is the checkpoint's Megatron-LM args")
            return model
        if args.recipe is None and args.model_json is None:
            raise ValueError(f"--load-megatron {args.load_megatron} stores no Megatron-LM args: give --recipe NAME "
                             "and model flags (the architecture it was trained with)")
    if args.load_hf is None:
        if args.moe_use_upcycling:
            raise ValueError("--moe-use-upcycling needs --load-hf DIR (the dense checkpoint to upcycle)")
        if args.recipe is None and args.model_json is None:
            raise ValueError("give --recipe NAME (the model the model flags change), --load-hf DIR or "
                             "--load-megatron DIR")
        model = apply_model_flags(_base_model(args), args)
        vocab = args.vocab_size if args.vocab_size is not None else tokenizer_vocab(args)
        return model.with_(vocab_size=vocab) if vocab is not None else model
    if args.recipe is not None:
        raise ValueError(f"--recipe {args.recipe} and --load-hf {args.load_hf}: give one (the model comes from "
                         "--load-hf's config.json)")
    from moefold.models.pretrained import pretrained_config

    allowed = UPCYCLING_FLAGS if args.moe_use_upcycling else ()
    refused = [f for f in given if f not in allowed] + arch_router + (["--vocab-size"] if args.vocab_size else []) \
        + (["--model-json"] if args.model_json else [])
    if refused:
        raise ValueError(f"{' '.join(refused)} cannot be combined with --load-hf: the architecture is "
                         f"{args.load_hf}'s config.json (flags may change training-side settings: parallelism, "
                         "recompute, dispatcher, balancing coefficients)"
                         + (f"; --moe-use-upcycling takes {' '.join(UPCYCLING_FLAGS)}" if args.moe_use_upcycling
                            else ""))
    model = pretrained_config(args.load_hf)
    if args.moe_use_upcycling:
        from moefold.models.upcycle import upcycled_config

        if args.num_experts is None:
            raise ValueError("--moe-use-upcycling needs --num-experts (the experts each MLP becomes)")
        model = upcycled_config(model, args.num_experts, args.moe_router_topk or 2, args.moe_ffn_hidden_size,
                                args.moe_layer_freq or 1)
    return model


def _base_model(args: argparse.Namespace) -> ModelConfig:
    """The model the model flags change: ``--model-json``'s (a config.yaml's ``model:`` section) or the recipe's."""
    if args.model_json is None:
        return get_recipe(args.recipe)
    try:
        return ModelConfig.from_dict(args.model_json)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--model-json (a --config file's model: section): {exc}") from None


def recorded_model(args: argparse.Namespace, config: RunConfig) -> ModelConfig | None:
    """The model ``config.yaml`` records in full (its ``model:`` section): the one the recipe (or ``--model-json``)
    and the flags made, so that a repeat does not depend on the recipe's code; None where the architecture is a
    directory's (``--load-hf``, ``--load-megatron`` with its args), recorded by its path."""
    return config.model if args.recipe is not None or args.model_json is not None else None


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig the flags describe (ValueError naming the flag on a bad value)."""
    for flag in ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout"):
        if getattr(args, flag) is not None and args.pipeline_model_parallel_size == 1:
            raise ValueError(f"--{flag.replace('_', '-')} needs --pipeline-model-parallel-size > 1")
    model = apply_router_flags(model_from_args(args), args)
    options = options_from_args(args, dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                                fp8=fp8_config_from_args(args), offload_modules=offload_modules_from_args(args))
    parallel = ParallelConfig(tp=args.tensor_model_parallel_size, cp=args.context_parallel_size,
                              pp=args.pipeline_model_parallel_size, ep=args.expert_model_parallel_size,
                              etp=args.expert_tensor_parallel_size)
    fields = set(TrainConfig.FLAT_NAMES)
    explicit = ("run_dir", "save", "load", "bf16", "data_path", "vocab_size", "data_cache_dir", "valid_data_path",
                "reset_data_position", "compile", "exit_signals", "run_id")
    if args.optimizer_offload_fraction != TrainConfig.optimizer_offload_fraction and not args.optimizer_cpu_offload:
        raise ValueError(f"--optimizer-offload-fraction {args.optimizer_offload_fraction} needs "
                         "--optimizer-cpu-offload")
    train = {k: v for k, v in vars(args).items() if k in fields and k not in explicit}
    # run_dir None / save None with neither --save nor --no-save: chosen by training.launch.claim before the ranks
    save = None if args.no_save or args.skip_train else args.save
    train = TrainConfig(**train, bf16=args.bf16, compile=args.compile, run_dir=args.run_dir, save=save, load=args.load,
                        exit_signals=tuple(args.exit_signal) if args.exit_signal_handler else (),
                        reset_data_position=args.reset_data_position,
                        data_path=tuple(args.data_path), vocab_size=args.vocab_size,
                        data_cache_dir=args.data_cache_dir, overlap_grad_reduce=not args.no_overlap_grad_reduce,
                        balance_report=not args.no_balance_report, valid_data_path=tuple(args.valid_data_path))
    return RunConfig(model=model, parallel=parallel, options=options, train=train, recipe=args.recipe)


def describe_parameters(model: ModelConfig) -> str:
    """The start-up line: total and active parameters of the model the flags describe (built on meta)."""
    from moefold.models.params import count_parameters, fmt_count

    r = count_parameters(model)
    mtp = f" (+{fmt_count(r.mtp_total)} MTP)" if r.mtp else ""
    return (f"model: {model.name} ({model.family}): {fmt_count(r.total)} parameters{mtp}, {fmt_count(r.active)} "
            f"active per token, {model.num_layers} layers, {model.num_experts} experts top-{model.moe_topk}"
            if model.num_experts else
            f"model: {model.name} ({model.family}, dense): {fmt_count(r.total)} parameters{mtp}, "
            f"{model.num_layers} layers")


def main(args: argparse.Namespace) -> int:
    """Validate the flags, claim the run's directories (``training.launch.claim``), run the pre-flight checks,
    start the ranks. Exit codes: 0 done (or a planned ``--exit-*`` stop, saved), 1 the run failed (one line on
    stderr, tracebacks in RUN_DIR/error.log), 2 a flag or pre-flight check failed, 128 + N stopped by signal N
    after saving (143 SIGTERM, 130 Ctrl-C, 138 SIGUSR1; ``training.launch.signals``)."""
    torchrun = launched_by_torchrun()
    try:
        config = config_from_args(args)
        world = launched_world_size() if torchrun else args.nproc
        if args.nproc < 1:
            raise ValueError(f"--nproc={args.nproc} must be >= 1")
        for flag in ("distributed_timeout_minutes", "heartbeat_timeout"):
            if not 0 < getattr(args, flag) < float("inf"):
                raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be a positive number")
        validate(config, world, world_source(args.nproc, torchrun))
        config, flex_line = resolve_flex(config, world)   # every rank runs the backend rank 0 records
    except (ValueError, ImportError, RuntimeError) as exc:
        print(f"moefold train: error: {exc}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    held: list = []   # the claim, once rank 0 holds one: the agent watch releases its lock
    agent = os.getppid()
    if torchrun:   # the ranks exist already: join them now, so that they agree on the run before it starts
        watch_parent(lambda agent: _agent_gone(rank, agent, held))
        join_torchrun(args.device, timedelta(minutes=args.distributed_timeout_minutes))
    claim, error = None, None
    try:
        if rank == 0:
            config, claim = claim_run(config, default_save=not (args.no_save or args.skip_train) and args.save is None,
                                      override_save=args.override_save, override_run_dir=args.override_run_dir)
    except (ValueError, ImportError, RuntimeError, OSError) as exc:
        error = str(exc)
    config, error = agree(config, error)
    if error is None:
        try:   # torchrun: every rank checks (a node's files are its own)
            preflight(config, say=print if rank == 0 else lambda _line: None, world_size=world,
                      resume_from=claim.resume_from if claim else None)
        except (ValueError, ImportError, RuntimeError) as exc:
            error = str(exc)
        error = first_error(error)
    if error is not None:
        if claim is not None:
            claim.abandon()
        if rank == 0:
            print(f"moefold train: error: {error}", file=sys.stderr)
        return 2
    if claim is not None:
        held.append(claim)
        claim.record()
        write_effective_config(train_parser(), args, config.train.run_dir, model=recorded_model(args, config))
    if rank == 0:
        print(describe_parameters(config.model), flush=True)
        if flex_line is not None:
            print(flex_line, flush=True)
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        allocator = tune_cpu_allocator()   # before any rank starts: they inherit it
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{describe_machine()}; host allocator: {allocator}", flush=True)
            notice = bf16_slower_notice() if config.train.bf16 else None
            if notice:
                print(f"moefold train: {notice}", file=sys.stderr, flush=True)
    if torchrun and args.nproc > 1:
        print(f"moefold train: launched by torchrun (world {world}); ignoring --nproc {args.nproc}", file=sys.stderr)
    try:
        outcome = run_ranks(train_worker, 1 if torchrun else args.nproc, args.device,
                            timeout_s=60 * args.distributed_timeout_minutes,
                            args=(json.dumps(config.to_dict()), not args.no_progress and sys.stderr.isatty()),
                            run_dir=config.train.run_dir, heartbeat_timeout_s=args.heartbeat_timeout,
                            stop_signals=signal_numbers(config.train.exit_signals))
    except JobFailed as exc:
        if torchrun and os.getppid() != agent:   # a peer that saw the agent go stopped first: that is the cause
            _agent_gone(rank, agent, held)
        spawned = world > 1 and not torchrun   # the log holds every rank's traceback
        where = f" (full traceback{'s' if spawned else ''}: {exc.log})" if exc.log else ""
        cut = "\n" if spawned else ""   # rank 0's progress bar may end mid-line
        print(f"{cut}moefold train: {exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moefold train: interrupted", file=sys.stderr)
        return 130
    finally:
        if claim is not None:
            claim.release()
    if outcome and outcome.get("stop"):
        stop = Stop(outcome["stop"], outcome["signum"])
        if rank == 0:
            print(stop_line(stop, outcome["step"], outcome["checkpoint"], config.train.save), file=sys.stderr)
        return stop.exit_code
    return 0


def _agent_gone(rank: int, agent: int, held: list) -> None:
    """torchrun's agent (this worker's parent) died without stopping its workers (``kill -9``): one line, the save
    lock released (rank 0 holds it), and out at once: the peers may be gone too, so nothing waits for them."""
    print(f"moefold train: rank {rank}: the torchrun agent (pid {agent}) is gone; stopping this worker"
          + (" and releasing the --save lock" if held else "") + " (resume with --load)", file=sys.stderr, flush=True)
    for claim in held:
        claim.release()
    os._exit(1)


def train_parser() -> argparse.ArgumentParser:
    """``moefold train``'s own parser (for the effective config it writes)."""
    parser = Parser(prog="moefold train")
    add_arguments(parser)
    return parser


def train_worker(device: torch.device, config_json: str, progress: bool = False,
                 heartbeat: Heartbeat | None = None) -> dict | None:
    """One rank of ``moefold train`` (module-level: spawned processes import it). Returns how the run ended:
    None when it trained to the end, else ``{"stop", "signum", "step", "checkpoint"}``."""
    from moefold.training.run import train

    interactive = heartbeat is None and not launched_by_torchrun()   # world 1: the process the user started
    summary = train(RunConfig.from_dict(json.loads(config_json)), device, heartbeat=heartbeat,
                    interactive=interactive, progress=progress)
    if summary.stop is None:
        return None
    return {"stop": summary.stop.reason, "signum": summary.stop.signum,
            "step": summary.last.step if summary.last else 0,
            "checkpoint": str(summary.checkpoint) if summary.checkpoint else None}


if __name__ == "__main__":
    from moefold.training.cli import main as cli_main

    sys.exit(cli_main(["train", *sys.argv[1:]]))
