"""``moefold plan``: which parallel layout fits and runs fastest, for a model and a cluster.

    moefold plan --recipe deepseek_v3 --gpus 2048 --gpus-per-node 8 --cluster h800 --gpu-memory 80GB \\
        --seq-length 4096 --global-batch-size 15360

The model is a recipe changed by the model flags, or an HF directory (``--hf DIR``); layout flags given on the
command line (``--tensor-model-parallel-size 2``, ``--recompute-granularity full``, ...) are fixed, the others
searched (``training.plan.search``). With every layout flag given, the plan of that one layout is printed, with
why it does not fit if it does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from moefold.dense.context_parallel import CP_COMM_MODES
from moefold.dense.recompute import RECOMPUTE_METHODS, RECOMPUTE_MODES, RECOMPUTE_MODULES
from moefold.dispatch.flex_backend import FLEX_BACKEND_CHOICES
from moefold.models.options import DEEPEP_MODES, ModelOptions
from moefold.models.params import count_parameters
from moefold.models.recipes import RECIPES
from moefold.moe.config import DISPATCHERS
from moefold.pipeline.schedules import SCHEDULES
from moefold.training.cli.model_flags import ARCH_FLAGS, add_model_arguments, dest
from moefold.training.cli.train import ROUTER_FLAGS, model_from_args
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.optim.precision import DTYPES
from moefold.training.plan.cluster import CLUSTERS, load_cluster, parse_bytes
from moefold.training.plan.nearest import alternatives, why_nothing_is_valid
from moefold.training.plan.report import HEADER, commands, heading, outcome, render, row, why_not
from moefold.training.plan.search import HEADROOM, Fixed, evaluate, recompute_ladder, search
from moefold.training.plan.step_time import EFFICIENCY

LAYOUT_FLAGS = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                "expert_model_parallel_size", "expert_tensor_parallel_size")
LAYOUT_HELP = {"tensor_model_parallel_size": "tensor parallelism (tp)", "context_parallel_size":
               "context parallelism (cp)", "pipeline_model_parallel_size": "pipeline stages (pp)",
               "expert_model_parallel_size": "expert parallelism (ep)",
               "expert_tensor_parallel_size": "expert tensor parallelism (etp)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", choices=sorted(RECIPES), metavar="NAME",
                   help=f"model recipe (the base the model flags change): {', '.join(sorted(RECIPES))}")
    p.add_argument("--hf", "--load-hf", dest="load_hf", metavar="DIR", default=None,
                   help="plan for the model of an HF directory's config.json (instead of --recipe)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, required=True, help="GPUs in all (the world size)")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node: ranks are numbered node by node "
                                                                 "(default 8)")
    c.add_argument("--cluster", default="h100",
                   help=f"GPU and network: {', '.join(CLUSTERS)} (presets with their sources) or FILE.toml "
                        "(default h100)")
    c.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GB (10^9) or 80GiB (default: the "
                                                     "cluster's)")
    c.add_argument("--memory-headroom", type=float, default=HEADROOM,
                   help=f"share of the GPU memory kept free for what the model does not count: CUDA context, "
                        f"NCCL buffers, allocator fragmentation (default {HEADROOM})")
    c.add_argument("--efficiency", type=float, default=None,
                   help="time every FLOP at this share of the dense bf16 peak (the flat model; e.g. "
                        f"{EFFICIENCY}); default: each GEMM at its shape and dtype from the published-figures "
                        "table (training.plan.gemm_efficiency), elementwise kernels by HBM bandwidth")
    t = p.add_argument_group("batch and precision")
    t.add_argument("--seq-length", type=int, default=4096, help="tokens per sample")
    t.add_argument("--global-batch-size", type=int, default=1024, help="sequences per step (default 1024)")
    t.add_argument("--micro-batch-size", type=int, default=None, help="default 1 (Megatron's MoE recipes)")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 parameters with fp32 master weights (default; --no-bf16: fp32)")
    for flag in ("--main-grads-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        t.add_argument(flag, default="fp32", choices=tuple(DTYPES), help="optimizer precision (as moefold train)")
    t.add_argument("--overlap-param-gather", action="store_true",
                   help="plan the parameter all-gather overlapped with the next forward (as moefold train)")
    g = p.add_argument_group("layout (each given flag is fixed; the others are searched)")
    for flag in LAYOUT_FLAGS:
        g.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                       help=f"{LAYOUT_HELP[flag]}; default: searched")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="virtual stages of M layers per rank; default: searched (even split, or 2 virtual stages)")
    g.add_argument("--pipeline-schedule", default=None, choices=SCHEDULES,
                   help="fix the pipeline schedule (default: searched: 1f1b, zb-h1, interleaved, zbv, dualpipev)")
    g.add_argument("--overlap-moe-expert-parallel-comm", dest="overlap", action=argparse.BooleanOptionalAction,
                   default=None, help="fix the batch-level overlap on or off (default: searched where ep > 1; on "
                                      "comes with --delay-wgrad-compute)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="shard activations along the sequence between TP regions (tp > 1)")
    g.add_argument("--cp-comm-type", default=ModelOptions.cp_comm, choices=CP_COMM_MODES,
                   help="context-parallel K/V exchange")
    g.add_argument("--moe-token-dispatcher-type", default="auto", choices=("auto", *DISPATCHERS),
                   help="the dispatcher to plan for (flex: DeepEP's buffers are counted)")
    g.add_argument("--moe-deepep-num-sms", type=int, default=ModelOptions.moe_deepep_num_sms,
                   help="SMs DeepEP's kernels take (flex dispatcher; 0: DeepEP V2's estimate, 20 with deepep-legacy)")
    g.add_argument("--moe-flex-dispatcher-backend", default=ModelOptions.moe_flex_dispatcher_backend,
                   choices=FLEX_BACKEND_CHOICES, help="flex: the DeepEP whose buffer and exchange are planned "
                   "(auto: deepep, V2)")
    g.add_argument("--moe-deepep-mode", default=ModelOptions.moe_deepep_mode, choices=DEEPEP_MODES,
                   help="DeepEP V2 across nodes: hybrid (RDMA once per node, NVLink forwarding) or direct")
    g.add_argument("--moe-deepep-cpu-sync", action=argparse.BooleanOptionalAction, default=None,
                   help="DeepEP V2: exact receive buffers (a host wait per dispatch) instead of worst-case ones; "
                   "default: on when the expert GEMMs take host counts")
    g.add_argument("--recompute-granularity", default=None, choices=RECOMPUTE_MODES,
                   help="fix the recompute setting; default: the least recompute that fits, per layout")
    g.add_argument("--recompute-modules", nargs="+", default=["core_attn"], choices=RECOMPUTE_MODULES,
                   metavar="MODULE", help="--recompute-granularity selective: the modules recomputed")
    g.add_argument("--recompute-method", default="uniform", choices=RECOMPUTE_METHODS,
                   help="--recompute-granularity full: uniform or block")
    g.add_argument("--recompute-num-layers", type=int, default=1,
                   help="--recompute-granularity full: the N of --recompute-method")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    o.add_argument("--plot", metavar="PNG", default=None, help="draw the top layouts' memory and time terms")
    add_model_arguments(p)
    p.set_defaults(moe_use_upcycling=False, vocab_size=None, load_megatron=None, tokenizer_type=None,
                   **{flag[2:].replace("-", "_"): None for flag, _, _ in ROUTER_FLAGS})


def model_flags(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """The model as the user gave it, for the printed commands: --recipe / --load-hf and the model flags."""
    out = ["--recipe", args.recipe] if args.recipe else ["--load-hf", args.load_hf]
    for flag, typ, _, _ in ARCH_FLAGS:
        value = getattr(args, dest(flag))
        if value is None:
            continue
        if typ is bool:
            out.append(flag if value else f"--no-{flag[2:]}")
            continue
        raw = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == flag]
        raw += [token.split("=", 1)[1] for token in argv if token.startswith(flag + "=")]
        out += [flag, raw[-1] if raw else str(value)]
    return out


def config_from_args(args: argparse.Namespace) -> tuple[RunConfig, Fixed]:
    """The run to plan (layout fields at their defaults where searched) and what the user fixed."""
    model = model_from_args(args)
    recompute = None
    if args.recompute_granularity is not None:
        recompute = {"recompute": args.recompute_granularity, "recompute_modules": tuple(args.recompute_modules),
                     "recompute_method": args.recompute_method, "recompute_num_layers": args.recompute_num_layers}
    options = ModelOptions(sequence_parallel=args.sequence_parallel, cp_comm=args.cp_comm_type,
                           dispatcher=args.moe_token_dispatcher_type, dtype="bf16" if args.bf16 else "fp32",
                           moe_deepep_num_sms=args.moe_deepep_num_sms,
                           moe_flex_dispatcher_backend=args.moe_flex_dispatcher_backend,
                           moe_deepep_mode=args.moe_deepep_mode, moe_deepep_cpu_sync=args.moe_deepep_cpu_sync,
                           **(recompute or {}))
    train = TrainConfig(micro_batch_size=args.micro_batch_size or 1, global_batch_size=args.global_batch_size,
                        seq_length=args.seq_length, bf16=args.bf16,
                        pipeline_schedule=args.pipeline_schedule or TrainConfig.pipeline_schedule,
                        overlap_moe_expert_parallel_comm=bool(args.overlap), delay_wgrad_compute=bool(args.overlap),
                        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
                        main_grads_dtype=args.main_grads_dtype, exp_avg_dtype=args.exp_avg_dtype,
                        exp_avg_sq_dtype=args.exp_avg_sq_dtype, overlap_param_gather=args.overlap_param_gather,
                        lr_warmup_iters=0)
    fixed = Fixed(tp=args.tensor_model_parallel_size, cp=args.context_parallel_size,
                  pp=args.pipeline_model_parallel_size, ep=args.expert_model_parallel_size,
                  etp=args.expert_tensor_parallel_size,
                  layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
                  micro_batch_size=args.micro_batch_size, recompute=recompute, schedule=args.pipeline_schedule,
                  overlap=args.overlap)
    return RunConfig(model=model, options=options, train=train, recipe=args.recipe), fixed


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if args.gpus < 1 or args.gpus_per_node < 1 or args.top < 1:
            raise ValueError(f"--gpus={args.gpus}, --gpus-per-node={args.gpus_per_node} and --top={args.top} must "
                             "be positive")
        if not 0 <= args.memory_headroom < 1:
            raise ValueError(f"--memory-headroom={args.memory_headroom} must be in [0, 1)")
        if args.efficiency is not None and not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency={args.efficiency} must be in (0, 1] (a share of the dense bf16 peak)")
        cluster = load_cluster(args.cluster)
        memory = parse_bytes(args.gpu_memory) if args.gpu_memory else cluster.memory_bytes
        config, fixed = config_from_args(args)
        if "linear_attention" in (config.model.layer_types or ()):
            raise ValueError(f"{config.model.name} has Gated DeltaNet (linear_attention) layers, which the planner's "
                             "activation-memory and step-time models do not describe; plan a model of attention "
                             "layers only")
    except ValueError as exc:
        print(f"moefold plan: {exc}", file=sys.stderr)
        return 2
    world, per_node = args.gpus, args.gpus_per_node
    report = count_parameters(config.model)
    params = (report.total + report.mtp_total, report.active + report.mtp_active)
    usable = int(memory * (1 - args.memory_headroom))
    flags = model_flags(args, argv)
    fully_fixed = all(getattr(args, f) is not None for f in LAYOUT_FLAGS) and args.micro_batch_size is not None
    if fully_fixed:
        plans = _one_layout(config, fixed, world, cluster, per_node, memory, args)
        if isinstance(plans, str):
            print(f"moefold plan: {why_nothing_is_valid(config, fixed, world, None) or plans}", file=sys.stderr)
            return 2
        print(heading(config, world, cluster, per_node, usable, memory, params))
        print(HEADER)
        print(row(1, plans, cluster))
        if not plans.fits:
            print(why_not(plans))
            return 1
        local, launcher = commands(plans, flags, per_node)
        print(local if world <= per_node else launcher)
        chosen = [plans]
    else:
        result = search(config, world, cluster, per_node, memory, fixed=fixed, top=args.top,
                        headroom=args.memory_headroom, efficiency=args.efficiency,
                        progress=lambda line: print(f"moefold plan: {line}", file=sys.stderr, flush=True))
        print(render(result, config, world, cluster, per_node, memory, params, flags, usable))
        chosen = result.plans
        if not chosen:
            if result.valid == 0:
                print(f"no layout is valid: {why_nothing_is_valid(config, fixed, world, result)}")
                for alt in alternatives(config, fixed, world):
                    near = search(config, alt.world, cluster, per_node, memory, fixed=alt.fixed, top=1,
                                  headroom=args.memory_headroom, efficiency=args.efficiency)
                    print(f"nearest: {alt.flags}: {outcome(near)}")
            return 1
    if args.plot:
        from moefold.training.plan.plot import plot_plans

        plot_plans(chosen, cluster, args.plot, title=f"{config.model.name} on {world} x {cluster.name}")
        print(f"plot: {args.plot}")
    return 0


def _one_layout(config: RunConfig, fixed: Fixed, world: int, cluster, per_node: int, memory: int,
                args: argparse.Namespace):
    """The plan of the one layout the flags fix (the least recompute that fits unless fixed too), or the error."""
    from moefold.parallel.dims import ParallelConfig

    config = dataclasses.replace(config, parallel=ParallelConfig(tp=fixed.tp, cp=fixed.cp, pp=fixed.pp, ep=fixed.ep,
                                                                 etp=fixed.etp))
    ladder = {"fixed": {}} if fixed.recompute is not None else recompute_ladder(config.model)
    plan = None
    try:
        for name, fields in ladder.items():
            planned = dataclasses.replace(config, options=dataclasses.replace(config.options, **fields))
            plan = evaluate(planned, world, cluster, per_node, memory, headroom=args.memory_headroom,
                            efficiency=args.efficiency, recompute=name if name != "fixed" else "")
            if plan.fits:
                return plan
    except ValueError as exc:
        return str(exc)
    return plan

