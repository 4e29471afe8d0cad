"""Show a simulated schedule: a text timeline (one row per rank) and a PNG (matplotlib, Agg)."""

from __future__ import annotations

import math
from pathlib import Path

from moefold.pipeline.schedules import Schedule
from moefold.pipeline.simulator import SimResult

CHUNK_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _label(kind: str, microbatch: int, chunk: int, vpp: int) -> str:
    return f"{kind}{microbatch}" + (CHUNK_LETTERS[chunk % 26] if vpp > 1 else "")


def render_text(schedule: Schedule, result: SimResult, step: float | None = None) -> str:
    """One row per rank, one column per ``step`` of time (default: the shortest compute).

    A compute shows as ``F3`` / ``B3`` (micro-batch 3; with vpp > 1 a letter names the chunk:
    ``F3b`` is micro-batch 3 on chunk 1), repeated over the columns it covers; ``.`` is idle.
    """
    durations = [end - start for rank in result.intervals for start, end, _ in rank]
    step = step or min(durations)
    columns = max(1, math.ceil(result.makespan / step - 1e-9))
    width = max(len(_label("F", schedule.num_microbatches - 1, schedule.vpp - 1, schedule.vpp)), 2) + 1
    header = f"time ({step:g} per column) ->"
    lines = [f"{schedule.name} pp={schedule.pp} vpp={schedule.vpp} microbatches={schedule.num_microbatches}",
             header]
    for r, rank in enumerate(result.intervals):
        cells = ["." * (width - 1)] * columns
        for start, end, a in rank:
            first = round(start / step)
            last = max(first + 1, round(end / step))
            for col in range(first, min(last, columns)):
                cells[col] = _label(a.kind, a.microbatch, a.chunk, schedule.vpp).ljust(width - 1)
        lines.append(f"rank {r} |" + " ".join(cells) + "|")
    lines.append(summary(schedule, result))
    return "\n".join(lines)


def summary(schedule: Schedule, result: SimResult) -> str:
    per_rank = ", ".join(f"{b:.3f}" for b in result.bubble_per_rank)
    return (f"bubble fraction {result.bubble_fraction:.4f} (per rank {per_rank}); makespan "
            f"{result.makespan:g}; peak in-flight (micro-batch, chunk) activations per rank "
            f"{list(result.peak_in_flight)}")


def plot_png(schedule: Schedule, result: SimResult, path: str | Path) -> Path:
    """Gantt chart of the simulated run: forwards blue, backwards green (shade = chunk)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp, vpp = schedule.pp, schedule.vpp
    fig, ax = plt.subplots(figsize=(max(8.0, result.makespan * 0.45), 0.6 * pp + 1.4))
    blues, greens = plt.get_cmap("Blues"), plt.get_cmap("Greens")
    for r, rank in enumerate(result.intervals):
        for start, end, a in rank:
            shade = 0.45 + 0.4 * (a.chunk / max(1, vpp - 1)) if vpp > 1 else 0.6
            color = (blues if a.kind == "F" else greens)(shade)
            ax.broken_barh([(start, end - start)], (r - 0.4, 0.8), facecolors=color, edgecolors="black",
                           linewidth=0.5)
            ax.text((start + end) / 2, r, _label("", a.microbatch, a.chunk, vpp), ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (forward = blue, backward = green)")
    ax.set_title(f"{schedule.name}: pp={pp} vpp={vpp} microbatches={schedule.num_microbatches}, "
                 f"bubble {result.bubble_fraction:.3f}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
