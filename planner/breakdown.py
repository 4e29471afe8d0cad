"""Each published run's step taken apart: which term its error comes from.

    python -m moefold.planner.breakdown      # one markdown row per published run, seconds per step

The compute term is split by kind (``compute_split``): single GEMMs (timed at their shape by
``planner.gemm_efficiency``, no constant), grouped expert GEMMs (x ``Calibration.grouped``), core attention and the
HBM-bound elementwise kernels (x ``Calibration.other``) in the proportions of the model's blocks for one micro-batch
(recompute included), and the host-bound time (``Calibration.layer_seconds``); beside them the exposed communication
(``tp``, ``cp``, ``ep``, ``pp``, ``dp``) and the pipeline bubble, all as the calibrated model gives them, and the
measured step they should add up to (``tokens per step / (measured tokens/s/GPU x GPUs)``; an MFU row the same way).
"""

from __future__ import annotations

import dataclasses
import sys

from moefold.planner.cluster import load_cluster
from moefold.planner.published import PUBLISHED_RUNS, PublishedRun, error
from moefold.planner.step_terms import CALIBRATION, COMM_TERMS, StepTime
from moefold.training.cli.train import validate_layout

KINDS = ("single GEMMs", "grouped GEMMs", "core attention", "elementwise", "host-bound")


def host_seconds(run: PublishedRun, st: StepTime) -> float:
    """The host-bound seconds in ``st``'s compute term: what ``Calibration.layer_seconds`` adds to it (the compute
    term, not the step: with the batch-level overlap a longer compute also hides more of the exchange)."""
    return st.terms["compute"] - run.step_time(dataclasses.replace(CALIBRATION, layer_seconds=0.0)).terms["compute"]


def compute_split(run: PublishedRun) -> dict[str, float]:
    """Shares of the run's step (calibrated) that its compute term spends, by kind (``KINDS``, module docstring; the
    optimizer step falls in with the kernels' shares). They add up to the compute term's share of the step."""
    from moefold.dense.recompute import recomputed_modules
    from moefold.models.layer_factory import is_moe_block
    from moefold.planner.compute_time import (
        ELEMENTWISE_SHARE,
        block_gemms,
        core_attention_seconds,
        elementwise_bytes,
        gemm_parts,
    )
    from moefold.planner.step_time import _score_macs

    config = run.config()
    sizes, cluster = validate_layout(config, run.gpus), load_cluster(run.cluster)
    m, t, o = config.model, config.train, config.options
    chosen = recomputed_modules(o.recompute, o.recompute_modules)
    tokens = t.micro_batch_size * t.seq_length / (sizes.tp * sizes.cp)
    gemm = grouped = attention = elementwise = 0.0
    for i in range(m.num_layers):
        every, some = gemm_parts(config, block_gemms(config, sizes, i), cluster, chosen, None)
        gemm, grouped = gemm + sum(every), grouped + sum(some)
        core = 2 * _score_macs(m, t.seq_length, i) * tokens
        fwd, bwd = core_attention_seconds(m, cluster, core)
        attention += fwd * (2 if "core_attn" in chosen else 1) + bwd
        bytes_ = 3 * elementwise_bytes(m, is_moe_block(m, i), o.fp8.enabled) * tokens
        elementwise += bytes_ / (ELEMENTWISE_SHARE * cluster.hbm_gbps * 1e9)
    cal = CALIBRATION
    parts = {"single GEMMs": gemm - grouped, "grouped GEMMs": cal.grouped * grouped,
             "core attention": cal.other * attention, "elementwise": cal.other * elementwise}
    st = run.step_time()
    host = host_seconds(run, st)
    kernels = (st.terms["compute"] - host) / st.total
    whole = sum(parts.values())
    return {**{kind: kernels * s / whole for kind, s in parts.items()}, "host-bound": host / st.total}


def measured_step(run: PublishedRun, st: StepTime) -> float:
    """Seconds of the run's step as published (``st``: the model's step, for the tokens and FLOPs per step)."""
    if run.metric == "MFU":
        return st.flops_per_gpu / (run.measured * run.cluster_peak_flops())
    return st.tokens_per_step / (run.measured * st.gpus)


def breakdown_row(run: PublishedRun) -> dict[str, float]:
    """Seconds per step of ``run`` by kind (``KINDS``), exposed communication, bubble and the rest (optimizer
    offload), the model's step, the measured step and the estimate's error."""
    st = run.step_time()
    split = compute_split(run)
    row = {kind: share * st.total for kind, share in split.items()}
    row["communication"] = sum(st.terms[t] for t in COMM_TERMS)
    row["bubble"] = st.terms["bubble"]
    row["offload"] = st.terms["offload"]
    row["model"], row["measured"] = st.total, measured_step(run, st)
    row["error"] = error(run, run.estimate())
    return row


def render(runs: tuple[PublishedRun, ...] = PUBLISHED_RUNS) -> str:
    cols = (*KINDS, "communication", "bubble")
    lines = ["| | run | " + " | ".join(cols) + " | model step | measured step | error |",
             "|---|---|" + "---|" * (len(cols) + 3)]
    for run in runs:
        row = breakdown_row(run)
        lines.append(f"| {'fitted' if run.fitted else 'held out'} | {run.name} | "
                     + " | ".join(f"{row[c]:.2f}" for c in cols)
                     + f" | {row['model']:.2f} | {row['measured']:.2f} | {100 * row['error']:+.0f}% |")
    lines += ["", f"Seconds per step, calibrated ({CALIBRATION})."]
    return "\n".join(lines)


def main() -> int:
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
