"""Where a step's ``aten::copy_`` time goes: the profile's copy total and its callers (``train_step.py --copies N``).

Every dtype cast, ``clone`` and ``contiguous`` ends in ``aten::copy_``, so its total says how much of a step is
data movement rather than arithmetic. ``step`` is profiled a few times (``torch.profiler`` with shapes and Python
stacks; medians: one profiled step on a shared machine can be off by half); each ``copy_`` is attributed to its
shape, the op it ran inside (``_to_copy`` for a cast, ``clone``, an autograd node) and the innermost moefold frame
above it (the Python line that asked for it; the trainer's backward call for the autograd engine's own casts, e.g.
``ToCopyBackward0`` returning an fp32 island's gradient in bf16).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable


def _frame(event) -> str:
    """The innermost Python frame of this repository above ``event`` (with_stack records Python calls as parent
    events named ``path(line): function``), as ``package/file.py(line): function``; "-" for none."""
    parent = event.cpu_parent
    while parent is not None:
        path = parent.name.replace("\\", "/")
        if "(" in path and "/benchmarks/" not in path:
            for pkg in ("parallel", "dense", "dispatch", "moe", "models", "pipeline", "training"):
                i = path.find(f"/{pkg}/")
                if i >= 0:
                    return path[i + 1:]
        parent = parent.cpu_parent
    return "-"


def _profile_once(step: Callable[[], None]) -> tuple[int, float, dict[tuple[str, str, str], list]]:
    from torch.profiler import profile

    with profile(record_shapes=True, with_stack=True) as prof:
        step()
    agg: dict[tuple[str, str, str], list] = collections.defaultdict(lambda: [0.0, 0])
    calls, total = 0, 0.0
    for e in prof.events():
        if e.name != "aten::copy_":
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "autograd::", "torch::autograd::")) \
                and "Backward" not in parent.name:
            parent = parent.cpu_parent
        inside = parent.name.replace("autograd::engine::evaluate_function: ", "") if parent is not None else "-"
        shape = str(list(e.input_shapes[0])) if e.input_shapes else "?"
        key = (shape, inside, _frame(e))
        agg[key][0] += e.self_cpu_time_total / 1e3
        agg[key][1] += 1
        calls += 1
        total += e.self_cpu_time_total / 1e3
    return calls, total, agg


def copy_callers(step: Callable[[], None], repeats: int = 3) -> tuple[int, list[float], list[tuple]]:
    """Profile ``step()`` ``repeats`` times (a shared machine: one profiled step can be off by half): (copy_ calls
    per step, each step's copy_ self CPU ms, [(median ms, calls, shape, inside op, moefold frame)] by time)."""
    runs = [_profile_once(step) for _ in range(repeats)]
    keys = {k for _, _, agg in runs for k in agg}
    rows = []
    for k in keys:
        ms = statistics.median(agg[k][0] if k in agg else 0.0 for _, _, agg in runs)
        rows.append((ms, max(agg[k][1] if k in agg else 0 for _, _, agg in runs), *k))
    rows.sort(key=lambda r: -r[0])
    return runs[0][0], [total for _, total, _ in runs], rows


def print_copy_callers(step: Callable[[], None], top: int, label: str, repeats: int = 3) -> None:
    calls, totals, rows = copy_callers(step, repeats)
    print(f"# {label}: aten::copy_ {statistics.median(totals):.1f} ms in {calls} calls per step (self CPU, median of "
          f"{repeats} profiled steps: {', '.join(f'{t:.0f}' for t in totals)} ms); top {top} callers (medians):")
    for ms, n, shape, inside, frame in rows[:top]:
        print(f"#   {ms:7.1f} ms x{n:<4d} {shape:18.18} in {inside[:26]:26} {frame}")


__all__ = ["copy_callers", "print_copy_callers"]
