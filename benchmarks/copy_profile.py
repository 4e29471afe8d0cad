"""Where a step's ``aten::copy_`` time goes: the profile's copy total and its callers (``train_step.py --copies N``).

Every dtype cast, ``clone`` and ``contiguous`` ends in ``aten::copy_``, so its total says how much of a step is
data movement rather than arithmetic. One profiled call of ``step`` (``torch.profiler`` with shapes and Python
stacks); each ``copy_`` is attributed to its shape, the op it ran inside (``_to_copy`` for a cast, ``clone``,
an autograd node) and the innermost moefold frame above it (the Python line that asked for it; none for the
autograd engine's own casts, e.g. ``ToCopyBackward0`` returning an fp32 island's gradient in bf16).
"""

from __future__ import annotations

import collections
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


def copy_callers(step: Callable[[], None]) -> tuple[int, float, list[tuple[float, int, str, str, str]]]:
    """Profile one ``step()``: (copy_ calls, their self CPU ms, [(ms, calls, shape, inside op, moefold frame)]
    sorted by time)."""
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
    rows = sorted(((ms, n, *k) for k, (ms, n) in agg.items()), key=lambda r: -r[0])
    return calls, total, rows


def print_copy_callers(step: Callable[[], None], top: int, label: str) -> None:
    calls, total, rows = copy_callers(step)
    print(f"# {label}: aten::copy_ {total:.1f} ms in {calls} calls (one profiled step, self CPU); top {top} callers:")
    for ms, n, shape, inside, frame in rows[:top]:
        print(f"#   {ms:7.1f} ms x{n:<4d} {shape:18.18} in {inside[:26]:26} {frame}")


__all__ = ["copy_callers", "print_copy_callers"]
