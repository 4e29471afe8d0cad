"""``moefold plan``: which parallel layout fits and runs fastest, for a model and a cluster.

    moefold plan --recipe deepseek_v3 --gpus 2048 --gpus-per-node 8 --cluster h800 --gpu-memory 80GB \\
        --seq-length 4096 --global-batch-size 15360

The model is a recipe changed by the model flags, or an HF directory (``--hf DIR``); layout flags given on the
command line (``--tensor-model-parallel-size 2``, ``--recompute-granularity full``, ...) are fixed, the others
searched (``planner.search``). With every layout flag given, the plan of that one layout is printed, with
why it does not fit if it does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from moefold.dense.activation_offload import OFFLOAD_MODULES
from moefold.dense.recompute import RECOMPUTE_METHODS, RECOMPUTE_MODES, RECOMPUTE_MODULES
from moefold.models.options import ModelOptions
from moefold.models.params import count_parameters
from moefold.models.recipes import RECIPES
from moefold.pipeline.schedules import SCHEDULES
from moefold.planner.candidates import Fixed
from moefold.planner.cluster import CLUSTERS, load_cluster, parse_bytes
from moefold.planner.nearest import alternatives, why_nothing_is_valid
from moefold.planner.report import HEADER, commands, heading, needs, outcome, render, row, why_not
from moefold.planner.search import HEADROOM, evaluate, recompute_ladder, search, stage_memory
from moefold.planner.step_time import EFFICIENCY
from moefold.training.cli.fp8_flags import add_fp8_arguments, fp8_config_from_args
from moefold.training.cli.model_flags import MODEL_FLAGS, add_model_arguments
from moefold.training.cli.option_flags import add_option_flags
from moefold.training.cli.train import model_from_args
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.optim.precision import DTYPES

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
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the recipe's model with this vocabulary (as moefold train's --vocab-size; default: the "
                        "recipe's)")
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
                        "table (planner.gemm_efficiency), elementwise kernels by HBM bandwidth")
    t = p.add_argument_group("batch and precision")
    t.add_argument("--seq-length", type=int, default=4096, help="tokens per sample")
    t.add_argument("--global-batch-size", type=int, default=1024, help="sequences per step (default 1024)")
    t.add_argument("--micro-batch-size", type=int, default=None, help="default 1 (Megatron's MoE recipes)")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 parameters with fp32 master weights (default; --no-bf16: fp32)")
    for flag in ("--main-grads-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        t.add_argument(flag, default="fp32", choices=tuple(DTYPES), help="optimizer precision (as moefold train)")
    add_fp8_arguments(t)
    t.add_argument("--overlap-param-gather", action="store_true",
                   help="plan the parameter all-gather overlapped with the next forward (as moefold train)")
    g = p.add_argument_group("layout (each given flag is fixed; the others are searched)")
    for flag in LAYOUT_FLAGS:
        g.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                       help=f"{LAYOUT_HELP[flag]}; default: searched")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="virtual stages of M layers per rank, an even split (num_layers divisible by pp x M); "
                        "default: searched")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None, metavar="VPP",
                   help="virtual stages per pipeline rank: the standard layouts (even, balanced, standalone loss/MTP) "
                        "of pp x VPP stages are searched; default: searched over 1, 2, 4")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help="fix Megatron's layout (e.g. 'Et|(tt|)*30mL'; as moefold train): pp must divide its stages")
    for which in ("first", "last"):
        g.add_argument(f"--decoder-{which}-pipeline-num-layers", type=int, default=None,
                       help=f"decoder layers on the {which} pipeline stage (an uneven split, as moefold train); "
                            "default: searched (even, or the remainder on the first and last stages)")
    g.add_argument("--pipeline-schedule", default=None, choices=SCHEDULES,
                   help="fix the pipeline schedule (default: searched: 1f1b, zb-h1, interleaved, zbv, dualpipev)")
    g.add_argument("--overlap-moe-expert-parallel-comm", dest="overlap", action=argparse.BooleanOptionalAction,
                   default=None, help="fix the batch-level overlap on or off (default: searched where ep > 1; on "
                                      "comes with --delay-wgrad-compute)")
    # the run-time flags, made from the fields they set (ModelOptions, its dispatch), as moefold train's
    add_option_flags(g, ("sequence_parallel", "cp_comm", "dispatcher", "flex.num_sms", "flex.backend",
                         "flex.hybrid", "flex.cpu_sync"))
    g.add_argument("--recompute-granularity", default=None, choices=RECOMPUTE_MODES,
                   help="fix the recompute setting; default: the least recompute that fits, per layout")
    g.add_argument("--recompute-modules", nargs="+", default=["core_attn"], choices=RECOMPUTE_MODULES,
                   metavar="MODULE", help="--recompute-granularity selective: the modules recomputed")
    g.add_argument("--recompute-method", default="uniform", choices=RECOMPUTE_METHODS,
                   help="--recompute-granularity full: uniform or block")
    g.add_argument("--recompute-num-layers", type=int, default=1,
                   help="--recompute-granularity full: the N of --recompute-method")
    s = p.add_argument_group("memory savers past ZeRO-1 (given: fixed; else FSDP2, optimizer offload and the ladder's "
                             "offload rung are searched)")
    s.add_argument("--fine-grained-activation-offloading", action="store_true",
                   help="fix activation offloading of --offload-modules (with --recompute-granularity, or none)")
    s.add_argument("--offload-modules", nargs="+", default=None, choices=OFFLOAD_MODULES, metavar="MODULE",
                   help=f"with --fine-grained-activation-offloading: any of {', '.join(OFFLOAD_MODULES)}")
    s.add_argument("--use-torch-fsdp2", action="store_true", help="fix FSDP2 (fully_shard) instead of searching it")
    s.add_argument("--optimizer-cpu-offload", action="store_true", help="fix optimizer offload")
    s.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="with --optimizer-cpu-offload: the share of the states on the host (default 1)")
    s.add_argument("--distributed-optimizer", action="store_true",
                   help="fix ZeRO-1 (the distributed optimizer, no FSDP2, no optimizer offload)")
    b = p.add_argument_group("routing imbalance")
    b.add_argument("--moe-max-load-ratio", type=float, default=None,
                   help="size the routed experts' activations for the worst expert receiving R x its share "
                        "(dropless); default: balanced routing")
    b.add_argument("--moe-expert-rank-capacity-factor", type=float, default=None,
                   help="Megatron's per-rank capacity: tokens beyond C x a rank's share are dropped, which bounds "
                        "its expert rows")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    o.add_argument("--plot", metavar="PNG", default=None, help="draw the top layouts' memory and time terms")
    o.add_argument("--exact", action="store_true",
                   help="re-plan the fastest layouts exactly: the trainer's buffers built on the meta device, the "
                        "schedule's action lists walked, the pipeline clock simulated (slower; default: formulas)")
    add_model_arguments(p)
    p.set_defaults(moe_use_upcycling=False, load_megatron=None, tokenizer_type=None,
                   **{e.dest: None for e in MODEL_FLAGS if e.group != "model"})


def model_flags(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """The model as the user gave it, for the printed commands: --recipe / --load-hf and the model flags."""
    out = ["--recipe", args.recipe] if args.recipe else ["--load-hf", args.load_hf]
    if args.vocab_size is not None:
        out += ["--vocab-size", str(args.vocab_size)]
    for e in MODEL_FLAGS:
        flag, value = e.flag, getattr(args, e.dest, None)
        if e.group != "model" or value is None:
            continue
        if e.type is None:
            out.append(flag if value else f"--no-{flag[2:]}")
            continue
        raw = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == flag]
        raw += [token.split("=", 1)[1] for token in argv if token.startswith(flag + "=")]
        out += [flag, raw[-1] if raw else str(value)]
    return out


def config_from_args(args: argparse.Namespace) -> tuple[RunConfig, Fixed]:
    """The run to plan (layout fields at their defaults where searched) and what the user fixed."""
    model = model_from_args(args)
    if args.moe_expert_rank_capacity_factor is not None:
        model = model.with_(moe_expert_rank_capacity_factor=args.moe_expert_rank_capacity_factor)
    from moefold.training.cli.train import offload_modules_from_args

    offload = offload_modules_from_args(args)
    recompute = None
    if args.recompute_granularity is not None or offload:
        recompute = {"recompute": args.recompute_granularity or "none",
                     "recompute_modules": tuple(args.recompute_modules),
                     "recompute_method": args.recompute_method, "recompute_num_layers": args.recompute_num_layers,
                     "offload_modules": offload}
    given = [name for name, on in (("fsdp", args.use_torch_fsdp2), ("cpu-adam", args.optimizer_cpu_offload),
                                   ("zero1", args.distributed_optimizer)) if on]
    if len(given) > 1:
        raise ValueError("give at most one of --use-torch-fsdp2, --optimizer-cpu-offload, --distributed-optimizer")
    options = ModelOptions(sequence_parallel=args.sequence_parallel, cp_comm=args.cp_comm_type,
                           dispatcher=args.moe_token_dispatcher_type, dtype="bf16" if args.bf16 else "fp32",
                           moe_deepep_num_sms=args.moe_deepep_num_sms,
                           moe_flex_dispatcher_backend=args.moe_flex_dispatcher_backend,
                           moe_deepep_mode=args.moe_deepep_mode, moe_deepep_cpu_sync=args.moe_deepep_cpu_sync,
                           fp8=fp8_config_from_args(args), **(recompute or {}))
    train = TrainConfig(micro_batch_size=args.micro_batch_size or 1, global_batch_size=args.global_batch_size,
                        seq_length=args.seq_length, bf16=args.bf16,
                        pipeline_schedule=args.pipeline_schedule or TrainConfig.pipeline_schedule,
                        overlap_moe_expert_parallel_comm=bool(args.overlap), delay_wgrad_compute=bool(args.overlap),
                        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
                        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
                        main_grads_dtype=args.main_grads_dtype, exp_avg_dtype=args.exp_avg_dtype,
                        exp_avg_sq_dtype=args.exp_avg_sq_dtype, overlap_param_gather=args.overlap_param_gather,
                        lr_warmup_iters=0, use_torch_fsdp2=args.use_torch_fsdp2,
                        optimizer_cpu_offload=args.optimizer_cpu_offload,
                        optimizer_offload_fraction=args.optimizer_offload_fraction,
                        moe_max_load_ratio=args.moe_max_load_ratio)
    fixed = Fixed(tp=args.tensor_model_parallel_size, cp=args.context_parallel_size,
                  pp=args.pipeline_model_parallel_size, ep=args.expert_model_parallel_size,
                  etp=args.expert_tensor_parallel_size,
                  layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
                  first_stage_layers=args.decoder_first_pipeline_num_layers,
                  last_stage_layers=args.decoder_last_pipeline_num_layers,
                  virtual_stages=args.num_virtual_stages_per_pipeline_rank,
                  layout=args.pipeline_model_parallel_layout, micro_batch_size=args.micro_batch_size,
                  recompute=recompute, sharding=given[0] if given else None, schedule=args.pipeline_schedule,
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
        _check_pipeline_flags(config, fixed)
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
        found = _one_layout(config, fixed, world, cluster, per_node, memory, args)
        if isinstance(found, str):
            print(f"moefold plan: {why_nothing_is_valid(config, fixed, world, None) or found}", file=sys.stderr)
            return 2
        plans, summary = found
        print(heading(config, world, cluster, per_node, usable, memory, params))
        print(HEADER)
        print(row(1, plans, cluster))
        print("\n".join(summary))
        if not plans.fits:
            print(why_not(plans))
            return 1
        local, launcher = commands(plans, flags, per_node)
        print(local if world <= per_node else launcher)
        chosen = [plans]
    else:
        result = search(config, world, cluster, per_node, memory, fixed=fixed, top=args.top,
                        headroom=args.memory_headroom, efficiency=args.efficiency, exact=args.exact,
                        progress=progress_bar)
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
    if chosen and chosen[0].sizes.pp > 1:
        print(stage_line(chosen[0], exact=fully_fixed or args.exact))
    if args.plot:
        from moefold.planner.plot import plot_plans

        plot_plans(chosen, cluster, args.plot, title=f"{config.model.name} on {world} x {cluster.name}")
        print(f"plot: {args.plot}")
    return 0


def progress_bar(phase: str, done: int, total: int, width: int = 30) -> None:
    """The search's progress on stderr: a bar redrawn in place on a terminal, else a status line."""
    if not sys.stderr.isatty():
        print(f"moefold plan: {phase}: {done} of {total}", file=sys.stderr, flush=True)
        return
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    print(f"\rmoefold plan: {phase:<10} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end,
          file=sys.stderr, flush=True)


def stage_line(plan, exact: bool = True) -> str:
    """Plan #1's layout and memory per GPU of every pipeline stage (GB: total = params + grads + optimizer +
    activations)."""
    layout = plan.config.pipeline_layout(plan.sizes.pp)
    per = " ".join(f"{m.pp_rank}:{m.total / 1e9:.1f}" for m in stage_memory(plan, exact))
    return f"#1 layout {layout.text} (pp {layout.pp} x vpp {layout.vpp}); memory per pipeline stage, GB: {per}"


def _check_pipeline_flags(config: RunConfig, fixed: Fixed) -> None:
    """The pipeline flags that can be refused before any search: a layout (at a fixed pp, or at none that
    divides its stages), vpp with a layout or an even split, an uneven even split."""
    given = [f for f, v in (("--num-layers-per-virtual-pipeline-stage", fixed.layers_per_virtual_stage),
                            ("--num-virtual-stages-per-pipeline-rank", fixed.virtual_stages),
                            ("--pipeline-model-parallel-layout", fixed.layout)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both fix the virtual stages: give one of them")
    if fixed.virtual_stages is not None and fixed.virtual_stages < 1:
        raise ValueError(f"--num-virtual-stages-per-pipeline-rank={fixed.virtual_stages} must be positive")
    n = config.model.num_layers
    if fixed.layers_per_virtual_stage is not None and fixed.pp and n % (fixed.pp * fixed.layers_per_virtual_stage):
        m = fixed.layers_per_virtual_stage
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage={m}: num_layers={n} is not divisible by "
                         f"pp x {m} = {fixed.pp * m} (an even split); for uneven virtual stages give "
                         f"--num-virtual-stages-per-pipeline-rank {max(round(n / (fixed.pp * m)), 1)} (the standard "
                         "layouts are searched) or --pipeline-model-parallel-layout")
    if fixed.layout is None:
        return
    from moefold.pipeline.layout import parse_layout

    stages = len(parse_layout(fixed.layout))
    pps = [fixed.pp] if fixed.pp else [p for p in range(1, stages + 1) if stages % p == 0 and (p > 1 or stages == 1)]
    errors = []
    for pp in pps:
        try:
            config.pipeline_layout(pp)
            return
        except ValueError as exc:
            errors.append(str(exc))
    raise ValueError(errors[0])


def _one_layout(config: RunConfig, fixed: Fixed, world: int, cluster, per_node: int, memory: int,
                args: argparse.Namespace):
    """(the plan of the one layout the flags fix, lines saying what it needs to fit under each sharding choice), or
    the error. Under each ``SHARDING`` choice (unless fixed) the least activation saving that fits (unless fixed);
    the fastest of those is the plan, else the closest."""
    from moefold.parallel.dims import ParallelConfig
    from moefold.planner.candidates import stage_splits
    from moefold.planner.search import SHARDING, _with_sharding

    # the pipeline split the search would take first (61 layers on pp16: 3 on the first stage, 2 on the last)
    split = next(stage_splits(config.model.num_layers, fixed.pp, fixed), {})
    config = dataclasses.replace(config, parallel=ParallelConfig(tp=fixed.tp, cp=fixed.cp, pp=fixed.pp, ep=fixed.ep,
                                                                 etp=fixed.etp),
                                 train=dataclasses.replace(config.train, **split))
    ladder = {"fixed": {}} if fixed.recompute is not None else recompute_ladder(config.model)
    fitting, closest, summary, refused = [], None, [], []
    for sharding in [fixed.sharding] if fixed.sharding else list(SHARDING):
        base = config if fixed.sharding else _with_sharding(config, sharding, world)
        if base is None:   # moefold train refuses this sharding with the layout: the others are still tried
            summary.append(f"with {sharding}: not with this layout (moefold train refuses it)")
            continue
        tried = 0
        for name, fields in ladder.items():
            planned = dataclasses.replace(base, options=dataclasses.replace(base.options, **fields))
            try:   # a rung moefold train refuses with this layout (offloading with the overlap) is skipped
                plan = evaluate(planned, world, cluster, per_node, memory, headroom=args.memory_headroom,
                                efficiency=args.efficiency, recompute=name if name != "fixed" else "")
            except ValueError as exc:
                refused.append(str(exc))
                continue
            tried += 1
            if closest is None or plan.memory.total < closest.memory.total:
                closest = plan
            if plan.fits:
                fitting.append(plan)
                summary.append(f"with {sharding}: fits with {needs(plan)} ({plan.memory.total / 1e9:.1f} GB, "
                               f"{plan.time.tokens_per_s_per_gpu:.0f} tok/s/GPU)")
                break
        else:
            summary.append(f"with {sharding}: does not fit with any activation saving" if tried else
                           f"with {sharding}: not with this layout ({refused[-1] if refused else 'refused'})")
    if fitting:
        return max(fitting, key=lambda p: p.time.tokens_per_s_per_gpu), summary
    if closest is None:
        return refused[0] if refused else "moefold train refuses every sharding choice with this layout"
    return closest, summary

