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


# One hue per kind of compute (the legend names each); with vpp > 1 the chunk is the hatch, never the shade, so
# that a lighter green always means an input-gradient backward and never "chunk a".
KIND_COLORS = {"F": "tab:blue", "B": "tab:green", "I": "yellowgreen", "W": "tab:purple"}
CHUNK_HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--")


def schedule_figure(schedule: Schedule, result: SimResult):
    """The Gantt chart of ``plot_png`` as a matplotlib Figure (Agg): one row per rank, a bar per compute with its
    micro-batch (and chunk letter); a legend below the axis names each kind's colour and, with vpp > 1, each
    chunk's hatch; an overlapped forward + backward is half forward, half backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp, vpp = schedule.pp, schedule.vpp
    # constrained layout keeps the axis label and the legend (placed "outside", below) inside the figure
    fig, ax = plt.subplots(figsize=(max(8.0, result.makespan * 0.45), 0.6 * pp + 2.0), layout="constrained")
    kinds: set[str] = set()

    def bar(kind: str, chunk: int, start: float, width: float, r: int) -> None:
        kinds.add(kind)
        ax.broken_barh([(start, width)], (r - 0.4, 0.8), facecolors=KIND_COLORS[kind], edgecolors="black",
                       linewidth=0.5, hatch=CHUNK_HATCHES[chunk % len(CHUNK_HATCHES)] if vpp > 1 else None)

    for r, rank in enumerate(result.intervals):
        for start, end, a in rank:
            if a.kind is ActionKind.FB:
                f, b = a.parts()
                middle = (start + end) / 2
                bar("F", f.chunk, start, middle - start, r)
                bar("B", b.chunk, middle, end - middle, r)
            else:
                bar(a.kind, a.chunk, start, end - start, r)
            ax.text((start + end) / 2, r, _label(a, vpp, kind=False), ha="center", va="center", fontsize=7,
                    bbox={"facecolor": "white", "alpha": 0.7, "pad": 0.5, "linewidth": 0} if vpp > 1 else None)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time")
    ax.set_title(f"{schedule.name}{' overlap' if schedule.overlap else ''}: pp={pp} vpp={vpp} "
                 f"microbatches={schedule.num_microbatches}, bubble {result.bubble_fraction:.3f}, peak activations "
                 f"{max(result.peak_in_flight)}", fontsize=9)
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="black", label=KIND_NAMES[k]) for k in KIND_COLORS
               if k in kinds]
    if vpp > 1:
        handles += [Patch(facecolor="white", edgecolor="black", hatch=CHUNK_HATCHES[c % len(CHUNK_HATCHES)],
                          label=f"chunk {CHUNK_LETTERS[c % 26]}") for c in range(vpp)]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    return fig


def plot_png(schedule: Schedule, result: SimResult, path: str | Path) -> Path:
    """Write ``schedule_figure`` as a PNG at ``path``; the saved area is grown to hold every label and the legend."""
    import matplotlib.pyplot as plt

    fig = schedule_figure(schedule, result)
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
