"""``moefold train --recipe NAME``: pretrain an MoE recipe, with Megatron-LM's flag names.

    moefold train --recipe qwen3_moe_tiny                          # built-in corpus, CPU, world 1
    moefold train --recipe qwen3_moe_tiny --nproc 4 --expert-model-parallel-size 2
    torchrun --nnodes 2 --nproc-per-node 8 -m training.cli train --recipe ... (multi-node)

The flags are validated against the layout (``RunConfig.resolve(world)``) in the parent process
before any rank starts; an impossible combination fails naming the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from moefold.models.options import ModelOptions
from moefold.models.recipes import RECIPES, get_recipe
from moefold.parallel.dims import ParallelConfig
from moefold.parallel.fp8 import add_fp8_arguments, fp8_config_from_args
from moefold.parallel.init import launched_by_torchrun, launched_world_size
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.launch import run_ranks
from moefold.training.lr_schedule import DECAY_STYLES, WSD_STYLES

_T = TrainConfig()

# Router flags (Megatron-LM names) -> the ModelConfig field they override; unset keeps the recipe's.
ROUTER_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--moe-router-score-function", "moe_score_function", str),
    ("--moe-router-pre-softmax", "moe_pre_softmax", bool),
    ("--moe-router-topk-scaling-factor", "moe_topk_scaling_factor", float),
    ("--moe-router-num-groups", "moe_num_groups", int),
    ("--moe-router-group-topk", "moe_group_topk", int),
    ("--moe-router-load-balancing-type", "moe_load_balancing_type", str),
    ("--moe-z-loss-coeff", "moe_z_loss_coeff", float),
    ("--moe-input-jitter-eps", "moe_input_jitter_eps", float),
    ("--moe-router-dtype", "moe_router_dtype", str),
    ("--moe-router-enable-expert-bias", "moe_expert_bias", bool),
    ("--moe-router-bias-update-rate", "moe_bias_update_rate", float),
    ("--moe-expert-capacity-factor", "moe_expert_capacity_factor", float),
    ("--moe-token-drop-policy", "moe_token_drop_policy", str),
    ("--moe-pad-expert-input-to-capacity", "moe_pad_expert_input_to_capacity", bool),
    ("--moe-router-force-load-balancing", "moe_router_force_load_balancing", bool),
    ("--moe-apply-probs-on-input", "moe_apply_probs_on_input", bool),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, choices=sorted(RECIPES), metavar="NAME",
                   help=f"model recipe: {', '.join(sorted(RECIPES))}")
    p.add_argument("--nproc", type=int, default=1, help="local ranks to spawn when not under torchrun (default 1)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="pp > 1: virtual stages of M layers per rank (interleaved 1F1B schedule)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="pp > 1: layers on the first stage (it also holds the embedding); default: even split")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="pp > 1: layers on the last stage (it also holds the head, loss and MTP); default: even split")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-schedule", dest="pipeline_schedule", default=_T.pipeline_schedule,
                   choices=("gpipe", "1f1b", "interleaved"), help="pp > 1 (interleaved is implied by virtual stages)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="shard activations along the sequence between TP regions (default on; tp > 1 only)")
    g.add_argument("--cp-comm-type", default=ModelOptions.cp_comm, help="context-parallel K/V exchange")
    m = p.add_argument_group("model (overrides of the recipe)")
    m.add_argument("--num-layers", type=int)
    m.add_argument("--num-experts", type=int)
    m.add_argument("--moe-router-topk", type=int)
    m.add_argument("--moe-aux-loss-coeff", type=float)
    for flag, _, typ in ROUTER_FLAGS:
        if typ is bool:
            m.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            m.add_argument(flag, type=typ)
    m.add_argument("--init-method-std", type=float, default=ModelOptions.init_std)
    m.add_argument("--moe-token-dispatcher-type", default="auto",
                   help="auto | local | allgather | alltoall | flex (DeepEP)")
    m.add_argument("--moe-grouped-gemm-backend", default=ModelOptions.gemm_backend)
    gpu = p.add_argument_group("GPU backends (issue 14): DeepEP, Transformer Engine FP8")
    gpu.add_argument("--moe-deepep-num-sms", type=int, default=ModelOptions.moe_deepep_num_sms,
                     help="SMs DeepEP's kernels take (flex dispatcher; even)")
    add_fp8_arguments(gpu)
    m.add_argument("--recompute-granularity", default="none", choices=("none", "selective", "full"))
    m.add_argument("--vocab-size", type=int, help="vocabulary of the built-in corpus (and the model); default: "
                                                   "the recipe's")
    t = p.add_argument_group("training")
    for flag, field, typ in (("--micro-batch-size", "micro_batch_size", int),
                             ("--global-batch-size", "global_batch_size", int), ("--seq-length", "seq_length", int),
                             ("--train-iters", "train_iters", int), ("--lr", "lr", float),
                             ("--min-lr", "min_lr", float), ("--lr-warmup-iters", "lr_warmup_iters", int),
                             ("--lr-decay-iters", "lr_decay_iters", int),
                             ("--lr-wsd-decay-iters", "lr_wsd_decay_iters", int),
                             ("--weight-decay", "weight_decay", float), ("--adam-beta1", "adam_beta1", float),
                             ("--adam-beta2", "adam_beta2", float), ("--adam-eps", "adam_eps", float),
                             ("--clip-grad", "clip_grad", float), ("--seed", "seed", int),
                             ("--log-interval", "log_interval", int), ("--save-interval", "save_interval", int),
                             ("--keep-last", "keep_last", int), ("--max-skipped-steps", "max_skipped_steps", int)):
        t.add_argument(flag, dest=field, type=typ, default=getattr(_T, field),
                       help=f"default {getattr(_T, field)}")
    t.add_argument("--lr-decay-style", dest="lr_decay_style", default=_T.lr_decay_style, choices=DECAY_STYLES)
    t.add_argument("--lr-wsd-decay-style", dest="lr_wsd_decay_style", default=_T.lr_wsd_decay_style,
                   choices=WSD_STYLES)
    t.add_argument("--bf16", action="store_true", help="bf16 parameters and compute, fp32 master weights")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (MoE: its static-shaped parts, the experts' "
                        "activation fused); compile time is printed")
    t.add_argument("--no-overlap-grad-reduce", action="store_true")
    d = p.add_argument_group("data and output")
    d.add_argument("--data-path", nargs="+", default=[], help="PREFIX or W1 PREFIX1 W2 PREFIX2 ... (prepared with "
                                                               "`moefold prepare-data`); default: built-in corpus")
    d.add_argument("--data-cache-dir", default=None)
    d.add_argument("--run-dir", default=_T.run_dir, help=f"metrics, logs and reports (default {_T.run_dir})")
    d.add_argument("--save", default=None, help="checkpoint directory (default RUN_DIR/checkpoints)")
    d.add_argument("--no-save", action="store_true", help="write no checkpoint")
    d.add_argument("--load", default=None, help="resume from the latest complete checkpoint in this directory")
    d.add_argument("--no-balance-report", action="store_true", help="skip the load-balance PNGs at the end")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig the flags describe (ValueError naming the flag on a bad value)."""
    for flag in ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers"):
        if getattr(args, flag) is not None and args.pipeline_model_parallel_size == 1:
            raise ValueError(f"--{flag.replace('_', '-')} needs --pipeline-model-parallel-size > 1")
    model = get_recipe(args.recipe)
    changes = {k: v for k, v in (("num_layers", args.num_layers), ("num_experts", args.num_experts),
                                 ("moe_topk", args.moe_router_topk), ("moe_aux_loss_coeff", args.moe_aux_loss_coeff),
                                 ("vocab_size", args.vocab_size)) if v is not None}
    for flag, field, _ in ROUTER_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            changes[field] = value
    if changes:
        model = model.with_(**changes)
    options = ModelOptions(sequence_parallel=args.sequence_parallel, cp_comm=args.cp_comm_type,
                           recompute=args.recompute_granularity, dispatcher=args.moe_token_dispatcher_type,
                           gemm_backend=args.moe_grouped_gemm_backend, dtype="bf16" if args.bf16 else "fp32",
                           init_std=args.init_method_std, fp8=fp8_config_from_args(args),
                           moe_deepep_num_sms=args.moe_deepep_num_sms)
    parallel = ParallelConfig(tp=args.tensor_model_parallel_size, cp=args.context_parallel_size,
                              pp=args.pipeline_model_parallel_size, ep=args.expert_model_parallel_size,
                              etp=args.expert_tensor_parallel_size)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    explicit = ("run_dir", "save", "load", "bf16", "data_path", "vocab_size", "data_cache_dir", "compile")
    train = {k: v for k, v in vars(args).items() if k in fields and k not in explicit}
    save = None if args.no_save else (args.save or os.path.join(args.run_dir, "checkpoints"))
    train = TrainConfig(**train, bf16=args.bf16, compile=args.compile, run_dir=args.run_dir, save=save, load=args.load,
                        data_path=tuple(args.data_path), vocab_size=args.vocab_size,
                        data_cache_dir=args.data_cache_dir, overlap_grad_reduce=not args.no_overlap_grad_reduce,
                        balance_report=not args.no_balance_report)
    return RunConfig(model=model, parallel=parallel, options=options, train=train, recipe=args.recipe)


def validate(config: RunConfig, world_size: int) -> None:
    """Everything checkable without starting ranks: layout sizes, batch arithmetic, model divisibility."""
    from moefold.models.layer_factory import check_layout
    from moefold.parallel.dims import ParallelDims

    try:
        sizes, _ = config.resolve(world_size)
    except ValueError as exc:
        t = config.train
        if config.parallel.pp > 1 and any(word in str(exc) for word in ("schedule", "num_layers", "pipeline")):
            uneven = "".join(f", --decoder-{k}-pipeline-num-layers={v}" for k, v in
                             (("first", t.decoder_first_pipeline_num_layers),
                              ("last", t.decoder_last_pipeline_num_layers)) if v is not None)
            raise ValueError(f"{exc} (--num-layers={config.model.num_layers}, --pipeline-model-parallel-size="
                             f"{config.parallel.pp}, --num-layers-per-virtual-pipeline-stage="
                             f"{t.num_layers_per_virtual_pipeline_stage}{uneven}, --global-batch-size="
                             f"{t.global_batch_size}, --micro-batch-size={t.micro_batch_size})") from exc
        raise
    try:
        check_layout(config.model, ParallelDims(sizes=sizes), config.options)
    except ValueError as exc:
        raise ValueError(f"{exc} (--tensor-model-parallel-size={sizes.tp}, --context-parallel-size={sizes.cp}, "
                         f"--expert-model-parallel-size={sizes.ep}, --expert-tensor-parallel-size={sizes.etp})"
                         ) from exc
    check_backends(config, sizes.ep, sizes.etp)


def check_backends(config: RunConfig, ep: int, etp: int) -> None:
    """The optional GPU backends the flags choose are installed and can run here (ImportError /
    ValueError / RuntimeError naming what to install or use instead), before any rank starts."""
    from moefold.moe.gemm import check_gemm_backend

    if config.train.compile:
        from moefold.training.compile import compile_unavailable

        reason = compile_unavailable("cuda" if torch.cuda.is_available() else "cpu")
        if reason is not None:
            raise RuntimeError(reason)
    o = config.options
    if config.model.num_experts:
        check_gemm_backend(o.gemm_backend, o.torch_dtype)
        if o.resolved_dispatcher(ep, etp) == "flex":
            from moefold.dispatch.deepep import import_deep_ep

            import_deep_ep()
    o.fp8.check_available()


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        world = launched_world_size() if launched_by_torchrun() else args.nproc
        if args.nproc < 1:
            raise ValueError(f"--nproc={args.nproc} must be >= 1")
        validate(config, world)
    except (ValueError, ImportError, RuntimeError) as exc:
        print(f"moefold train: error: {exc}", file=sys.stderr)
        return 2
    if launched_by_torchrun() and args.nproc > 1:
        print(f"moefold train: launched by torchrun (world {world}); ignoring --nproc {args.nproc}", file=sys.stderr)
    run_ranks(train_worker, 1 if launched_by_torchrun() else args.nproc, args.device,
              args=(json.dumps(config.to_dict()),))
    return 0


def train_worker(device: torch.device, config_json: str) -> None:
    """One rank of ``moefold train`` (module-level: spawned processes import it)."""
    from moefold.training.run import train

    train(RunConfig.from_dict(json.loads(config_json)), device)


if __name__ == "__main__":
    from moefold.training.cli import main as cli_main

    sys.exit(cli_main(["train", *sys.argv[1:]]))
