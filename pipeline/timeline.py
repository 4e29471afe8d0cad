"""Show a simulated schedule: a text timeline (one row per rank) and a PNG (matplotlib, Agg)."""

from __future__ import annotations

import math
from pathlib import Path

from moefold.pipeline.actions import Action, ActionKind
from moefold.pipeline.schedules import Schedule
from moefold.pipeline.simulator import SimResult

CHUNK_LETTERS = "abcdefghijklmnopqrstuvwxyz"
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)",
              "FB": "overlapped forward + backward"}


def _label(action: Action, vpp: int, kind: bool = True) -> str:
    """``F3b`` (kind, micro-batch, chunk letter when vpp > 1); an overlapped pair ``F3bB1a``; without ``kind``
    ``3b`` / ``3b|1a``."""
    def one(a: Action) -> str:
        return (a.kind if kind else "") + f"{a.microbatch}" + (CHUNK_LETTERS[a.chunk % 26] if vpp > 1 else "")

    if action.kind is ActionKind.FB:
        return ("" if kind else "|").join(one(p) for p in action.parts())
    return one(action)


def render_text(schedule: Schedule, result: SimResult, step: float | None = None) -> str:
    """One row per rank, one column per ``step`` of time (default: the shortest compute).

    A compute shows as ``F3`` / ``B3`` / ``I3`` / ``W3`` (micro-batch 3; with vpp > 1 a letter names the chunk:
    ``F3b`` is micro-batch 3 on chunk 1; an overlapped pair ``F3bB1a``), repeated over the columns it covers;
    ``.`` is idle.
    """
    durations = [end - start for rank in result.intervals for start, end, _ in rank]
    step = step or min(durations)
    columns = max(1, math.ceil(result.makespan / step - 1e-9))
    width = max(len(_label(a, schedule.vpp)) for rank in result.intervals for _, _, a in rank) + 1
    header = f"time ({step:g} per column) ->"
    overlap = " overlap" if schedule.overlap else ""
    lines = [f"{schedule.name}{overlap} pp={schedule.pp} vpp={schedule.vpp} ({schedule.placement.value} placement) "
             f"microbatches={schedule.num_microbatches}", header]
    for r, rank in enumerate(result.intervals):
        cells = ["." * (width - 1)] * columns
        for start, end, a in rank:
            first = round(start / step)
            last = max(first + 1, round(end / step))
            for col in range(first, min(last, columns)):
                cells[col] = _label(a, schedule.vpp).ljust(width - 1)
        lines.append(f"rank {r} |" + " ".join(cells) + "|")
    lines.append(summary(schedule, result))
    return "\n".join(lines)


def summary(schedule: Schedule, result: SimResult) -> str:
    per_rank = ", ".join(f"{b:.3f}" for b in result.bubble_per_rank)
    idle = ", ".join(f"{result.makespan - b:g}" for b in result.busy)
    return (f"bubble fraction {result.bubble_fraction:.4f} (per rank {per_rank}; idle time per rank {idle}); "
            f"makespan {result.makespan:g}; peak in-flight (micro-batch, chunk) activations per rank "
            f"{list(result.peak_in_flight)}; parameters per rank: {schedule.vpp} chunk(s) of "
            f"1/{schedule.num_model_chunks} of the layers")


_COLORS = {"F": ("Blues", 0.6), "B": ("Greens", 0.6), "I": ("Greens", 0.4), "W": ("Purples", 0.5)}


def plot_png(schedule: Schedule, result: SimResult, path: str | Path) -> Path:
    """Gantt chart of the simulated run: forwards blue, backwards green (input-only lighter), weight gradients
    purple, an overlapped forward + backward half blue, half green (shade = chunk)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp, vpp = schedule.pp, schedule.vpp
    fig, ax = plt.subplots(figsize=(max(8.0, result.makespan * 0.45), 0.6 * pp + 1.4))

    def color(kind: str, chunk: int):
        cmap, shade = _COLORS[kind]
        return plt.get_cmap(cmap)(shade - 0.15 + 0.3 * (chunk / max(1, vpp - 1)) if vpp > 1 else shade)

    for r, rank in enumerate(result.intervals):
        for start, end, a in rank:
            if a.kind is ActionKind.FB:
                f, b = a.parts()
                middle = (start + end) / 2
                ax.broken_barh([(start, middle - start)], (r - 0.4, 0.8), facecolors=color("F", f.chunk),
                               edgecolors="black", linewidth=0.5)
                ax.broken_barh([(middle, end - middle)], (r - 0.4, 0.8), facecolors=color("B", b.chunk),
                               edgecolors="black", linewidth=0.5)
            else:
                ax.broken_barh([(start, end - start)], (r - 0.4, 0.8), facecolors=color(a.kind, a.chunk),
                               edgecolors="black", linewidth=0.5)
            ax.text((start + end) / 2, r, _label(a, vpp, kind=False), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (forward blue, backward green, input-gradient backward light green, weight gradients "
                  "purple, overlapped pair blue|green)")
    ax.set_title(f"{schedule.name}{' overlap' if schedule.overlap else ''}: pp={pp} vpp={vpp} "
                 f"microbatches={schedule.num_microbatches}, bubble {result.bubble_fraction:.3f}, peak activations "
                 f"{max(result.peak_in_flight)}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
