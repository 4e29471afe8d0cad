"""What ``moefold plan`` prints: the ranked table (memory by component, step time by term), the exact
``moefold train`` and ``torchrun`` command of each layout, and why a layout does not fit.

Memory is in GB (10^9 bytes, like ``--gpu-memory 80GB``) per GPU, for the pipeline stage that needs the most;
step-time terms are seconds per step after overlap (``planner.step_time``).
"""

from __future__ import annotations

import shlex

from moefold.planner.cluster import Cluster
from moefold.planner.search import COMPONENTS, Plan, SearchResult, recompute_ladder
from moefold.planner.step_terms import TERMS
from moefold.precision.fp8 import FP8Config
from moefold.training.config import RunConfig, TrainConfig

_T = TrainConfig()
GB = 1e9


def train_flags(plan: Plan, model_flags: list[str]) -> list[str]:
    """The ``moefold train`` flags of ``plan``: ``model_flags`` (the model as the user gave it: --recipe NAME or
    --load-hf DIR and any model flags) and every flag of the layout, batch, recompute and precision."""
    c, s = plan.config, plan.sizes
    t, o = c.train, c.options
    flags = list(model_flags)
    if t.bf16:
        flags.append("--bf16")
    if t.fp16:
        flags.append("--fp16")
    flags += ["--seq-length", t.seq_length, "--global-batch-size", t.global_batch_size,
              "--micro-batch-size", t.micro_batch_size,
              "--tensor-model-parallel-size", s.tp, "--context-parallel-size", s.cp,
              "--pipeline-model-parallel-size", s.pp, "--expert-model-parallel-size", s.ep,
              "--expert-tensor-parallel-size", s.etp]
    for field in ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                  "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout"):
        if getattr(t, field) is not None:
            flags += [f"--{field.replace('_', '-')}", getattr(t, field)]
    if s.pp > 1 and t.pipeline_schedule != _T.pipeline_schedule:
        flags += ["--pipeline-schedule", t.pipeline_schedule]
    if t.overlap_moe_expert_parallel_comm:
        flags.append("--overlap-moe-expert-parallel-comm")
    if t.delay_wgrad_compute:
        flags.append("--delay-wgrad-compute")
    if not o.sequence_parallel and s.tp > 1:
        flags.append("--no-sequence-parallel")
    if s.cp > 1 and o.cp_comm != "p2p":
        flags += ["--cp-comm-type", o.cp_comm]
    if o.dispatcher is not None:   # None: auto
        flags += ["--moe-token-dispatcher-type", o.dispatcher.value]
    if o.recompute != "none":
        flags += ["--recompute-granularity", o.recompute]
        if o.recompute == "selective":
            flags += ["--recompute-modules", *o.recompute_modules]
        else:
            flags += ["--recompute-method", o.recompute_method, "--recompute-num-layers", o.recompute_num_layers]
    if o.offload_modules:
        flags += ["--fine-grained-activation-offloading", "--offload-modules", *o.offload_modules]
    if t.use_torch_fsdp2:
        flags.append("--use-torch-fsdp2")
    if t.optimizer_cpu_offload:
        flags += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", f"{t.optimizer_offload_fraction:g}"]
    if t.moe_max_load_ratio is not None:
        flags += ["--moe-max-load-ratio", f"{t.moe_max_load_ratio:g}"]
    for field in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(t, field) != getattr(_T, field):
            flags += [f"--{field.replace('_', '-')}", getattr(t, field)]
    flags += fp8_flags(o.fp8)
    if t.overlap_param_gather:
        flags.append("--overlap-param-gather")
    if not t.overlap_grad_reduce:
        flags.append("--no-overlap-grad-reduce")
    return [str(f) for f in flags]


def fp8_flags(fp8: FP8Config) -> list[str]:
    """``moefold train``'s FP8/FP4 flags that give ``fp8`` (none when it is off)."""
    if not fp8.enabled:
        return []
    out = ["--fp4-format", fp8.fp4] if fp8.fp4 else ["--fp8-format", str(fp8.format), "--fp8-recipe", str(fp8.recipe)]
    if fp8.backend != FP8Config.backend:
        out += ["--fp8-backend", str(fp8.backend)]
    if fp8.dispatch:
        out.append("--moe-fp8-dispatch")
    return out


def commands(plan: Plan, model_flags: list[str], gpus_per_node: int) -> tuple[str, str]:
    """(``moefold train`` command, ``torchrun`` command) that run ``plan``."""
    flags = shlex.join(train_flags(plan, model_flags))
    world = plan.sizes.world_size
    nodes, per_node = max(world // gpus_per_node, 1), min(world, gpus_per_node)
    local = f"moefold train --nproc {world} {flags}" if world <= gpus_per_node else f"moefold train {flags}"
    rdzv = "" if nodes == 1 else " --rdzv-backend c10d --rdzv-endpoint $MASTER:29500"
    launcher = f"torchrun --nnodes {nodes} --nproc-per-node {per_node}{rdzv} -m moefold.training.cli train {flags}"
    return local, launcher


def _gb(n: float) -> str:
    return f"{n / GB:.1f}"


HEADER = (f"{'#':>2} {'tp':>2} {'cp':>2} {'pp':>3} {'vpp':>3} {'dp':>4} {'ep':>3} {'etp':>3} {'edp':>4} {'mbs':>3} "
          f"{'schedule':<14} {'recompute':<10} {'sharding':<8} | {'params':>6} {'grads':>6} {'optim':>6} "
          f"{'activ':>6} {'buffer':>6} {'total':>6} {'host':>6} {'stage':>5} | {'step s':>7} "
          + " ".join(f"{t:>7}" for t in TERMS)
          + f" | {'tok/s/GPU':>9} {'MFU':>5}")


def row(i: int, plan: Plan, cluster: Cluster) -> str:
    s, m = plan.sizes, plan.memory
    c = m.components
    memory = (" ".join(f"{_gb(c[k]):>6}" for k in COMPONENTS) + f" {_gb(m.total):>6} {_gb(m.host):>6} "
              f"{m.pp_rank:>5}")
    layout = (f"{i:>2} {s.tp:>2} {s.cp:>2} {s.pp:>3} {plan.vpp:>3} {s.dp:>4} {s.ep:>3} {s.etp:>3} {s.edp:>4} "
              f"{plan.config.train.micro_batch_size:>3} {plan.schedule:<14} {plan.recompute:<10} {plan.sharding:<8}")
    if plan.time is None:
        return f"{layout} | {memory} |"
    t = plan.time
    terms = " ".join(f"{t.terms.get(k, 0.0):>7.3f}" for k in TERMS)
    return (f"{layout} | {memory} | {t.total:>7.3f} {terms} | {t.tokens_per_s_per_gpu:>9.0f} "
            f"{t.mfu(cluster):>5.1%}")


def heading(config: RunConfig, world: int, cluster: Cluster, gpus_per_node: int, usable: int, memory: int,
            params: tuple[int, int]) -> str:
    t = config.train
    total, active = params
    return (f"moefold plan: {config.model.name} ({total / 1e9:.1f}B parameters, {active / 1e9:.1f}B active), "
            f"{'bf16' if t.bf16 else 'fp32'} parameters, seq {t.seq_length}, global batch {t.global_batch_size} "
            f"({t.global_batch_size * t.seq_length / 1e6:.1f}M tokens)\n"
            f"cluster: {world} x {cluster.name} ({world // gpus_per_node or 1} nodes of {gpus_per_node}): "
            f"{memory / GB:.0f} GB, {cluster.bf16_tflops:g} dense bf16 TFLOP/s"
            f"{f', {cluster.fp8_tflops:g} FP8' if cluster.fp8_tflops else ', no FP8 units'}, "
            f"HBM {cluster.hbm_gbps:g} GB/s, "
            f"NVLink {cluster.nvlink_gbps:g} GB/s, "
            f"network {cluster.internode_gbps:g} GB/s per GPU; usable memory {usable / GB:.1f} GB per GPU")


def why_not(plan: Plan) -> str:
    """One line: the memory a non-fitting plan needs, against what is usable (how much over), and its largest
    component."""
    m = plan.memory
    c = m.components
    if plan.fits_gpu and not plan.fits_host:
        return (f"does not fit: pipeline stage {m.pp_rank} needs {_gb(m.host)} GB of host memory per GPU (offloaded "
                f"activations and optimizer states) of {_gb(plan.host_usable)} GB usable")
    parts = ", ".join(f"{k} {_gb(v)}" for k, v in c.items() if v)
    kind = "at least " if not m.static.exact else ""
    return (f"does not fit: pipeline stage {m.pp_rank} needs {kind}{_gb(m.total)} GB per GPU ({parts}) of "
            f"{_gb(plan.usable)} GB usable, {kind}{_gb(m.total - plan.usable)} GB over; largest component: "
            f"{m.largest} ({_gb(c[m.largest])} GB)")


def layout_name(p: Plan) -> str:
    s = p.sizes
    sharding = "" if p.sharding == "zero1" else f" {p.sharding}"
    return (f"tp{s.tp} cp{s.cp} pp{s.pp} ep{s.ep} etp{s.etp} mbs{p.config.train.micro_batch_size} {p.schedule} "
            f"{p.recompute}{sharding}")


def outcome(result: SearchResult) -> str:
    """What a search found, in one line: its best layout, or why nothing fits."""
    if result.plans:
        p = result.plans[0]
        return (f"fits ({result.fitting} layouts); best {layout_name(p)}: {_gb(p.memory.total)} GB per GPU, "
                f"{p.time.tokens_per_s_per_gpu:.0f} tok/s/GPU")
    if result.closest is not None:
        return f"no layout fits; closest {layout_name(result.closest)} {why_not(result.closest)}"
    return f"no valid layout either ({rejections(result)})"


def rejections(result: SearchResult, top: int = 3) -> str:
    """The commonest reasons the search's layouts were refused, with their counts."""
    common = sorted(result.rejected.items(), key=lambda kv: -kv[1])[:top]
    return "; ".join(f"{n} x {text}" for text, n in common) or "no layout considered"


SAVINGS = {"selective": "recompute core attention", "selective+": "recompute the cheap modules",
           "offload": "offload core attention and the experts' first GEMM", "full": "full recompute"}


def needs(plan: Plan) -> str:
    """What a fitting plan needs past ZeRO-1 with no recompute, in words (the report's "needs" column): the
    recompute and offloading its options hold (the modules named when they are not a ladder rung's), the sharding."""
    o = plan.config.options
    rung = recompute_ladder(plan.config.model).get(plan.recompute)
    if plan.recompute in SAVINGS and all(getattr(o, k) == v for k, v in rung.items()):
        out = [SAVINGS[plan.recompute]]
    elif o.recompute == "full":
        out = [f"full recompute ({o.recompute_method}, {o.recompute_num_layers} layers)"]
    else:
        out = [f"recompute {' '.join(o.recompute_modules)}"] if o.recompute == "selective" else []
        out += [f"offload {' '.join(o.offload_modules)}"] if o.offload_modules else []
    out += {"fsdp": ["FSDP2"], "cpu-adam": ["optimizer offload"]}.get(plan.sharding, [])
    return ", ".join(out) or "nothing"


def unranked(result: SearchResult) -> str:
    """The valid layouts the search did not plan (branch and bound), in words; empty when it planned them all."""
    if not result.unranked:
        return ""
    return (f"; {result.unranked} not planned: a lower bound of their step (compute, unhidden TP/CP/EP communication, "
            "bubble) is above the step of each layout printed")


def render(result: SearchResult, config: RunConfig, world: int, cluster: Cluster, gpus_per_node: int, memory: int,
           params: tuple[int, int], model_flags: list[str], usable: int) -> str:
    """The whole report of a search."""
    lines = [heading(config, world, cluster, gpus_per_node, usable, memory, params),
             f"layouts: {result.considered} considered, {result.valid} valid for moefold train, {result.fitting} fit "
             f"(each with the fastest of the least activation savings it needs under ZeRO-1, FSDP2 and optimizer "
             f"offload){unranked(result)}; ranked by tokens/s/GPU", ""]
    if not result.plans:
        lines.append("no layout fits.")
        if result.closest is not None:
            p = result.closest
            lines.append(f"closest: {layout_name(p)}: {why_not(p)}")
        return "\n".join(lines)
    lines += ["memory per GPU in GB (the fullest pipeline stage); step time in seconds by term (after overlap; ep: the "
              "expert exchange left exposed, +ov schedules hiding it behind the other micro-batch's compute)",
              HEADER, "-" * len(HEADER)]
    lines += [row(i + 1, p, cluster) for i, p in enumerate(result.plans)]
    lines.append("")
    lines += [f"#{i + 1} needs: {needs(p)}" for i, p in enumerate(result.plans)]
    lines.append("")
    for i, p in enumerate(result.plans):
        local, launcher = commands(p, model_flags, gpus_per_node)
        lines += [f"#{i + 1}: {local}" if world <= gpus_per_node else f"#{i + 1}: {launcher}"]
    return "\n".join(lines)
