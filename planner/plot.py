"""``moefold plan --plot plan.png``: the top layouts' memory components and step-time terms, side by side.

Left: stacked bars of GB per GPU (the fullest pipeline stage) by component, with the usable memory as a line;
right: stacked bars of seconds per step by term (after overlap), each bar labelled with its tokens/s/GPU.
"""

from __future__ import annotations

from moefold.planner.cluster import Cluster
from moefold.planner.report import GB
from moefold.planner.search import COMPONENTS, Plan
from moefold.planner.step_terms import TERMS


def label(plan: Plan) -> str:
    s = plan.sizes
    parts = [f"tp{s.tp}", f"cp{s.cp}" if s.cp > 1 else "", f"pp{s.pp}" + (f"x{plan.vpp}" if plan.vpp > 1 else ""),
             f"ep{s.ep}", f"etp{s.etp}" if s.etp > 1 else "", f"mbs{plan.config.train.micro_batch_size}",
             plan.recompute, plan.sharding if plan.sharding != "zero1" else ""]
    return " ".join(p for p in parts if p)


def plot_plans(plans: list[Plan], cluster: Cluster, path: str, title: str = "") -> None:
    """Write the figure of ``plans`` (timed plans; in the order given) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not plans:
        raise ValueError("--plot: no layout to draw (none fits)")
    names = [f"#{i + 1} {label(p)}" for i, p in enumerate(plans)]
    y = list(range(len(plans)))[::-1]
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(15, 2.2 + 0.6 * len(plans)), sharey=True)
    left = [0.0] * len(plans)
    for component in COMPONENTS:
        values = [p.memory.components[component] / GB for p in plans]
        if any(values):
            mem_ax.barh(y, values, left=left, label=component)
            left = [a + b for a, b in zip(left, values)]
    mem_ax.axvline(plans[0].usable / GB, color="black", linestyle="--", label="usable")
    mem_ax.set_xlabel("GB per GPU (fullest pipeline stage)")
    mem_ax.set_yticks(y, names)
    mem_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(plans)), ncol=6, fontsize="small")
    left = [0.0] * len(plans)
    for term in TERMS:
        values = [p.time.terms.get(term, 0.0) if p.time else 0.0 for p in plans]
        if any(values):
            time_ax.barh(y, values, left=left, label=term)
            left = [a + b for a, b in zip(left, values)]
    for yi, p, total in zip(y, plans, left):
        if p.time is not None:
            time_ax.text(total, yi, f" {p.time.tokens_per_s_per_gpu:,.0f} tok/s/GPU, MFU {p.time.mfu(cluster):.0%}",
                         va="center", fontsize="small")
    time_ax.set_xlabel("seconds per step (after overlap)")
    time_ax.set_xlim(0, max(left) * 1.45 if max(left) > 0 else 1)
    time_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(plans)), ncol=7, fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
