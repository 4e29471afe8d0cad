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
        path = "/" + parent.name.replace("\\", "/")   # absolute, or relative to a sys.path entry
        if "(" in path and "/benchmarks/" not in path:
            for pkg in ("parallel", "precision", "dense", "dispatch", "moe", "models", "pipeline", "training",
                        "planner", "tools"):
                i = path.find(f"/{pkg}/")
                if i >= 0:
                    return path[i + 1:]
        parent = parent.cpu_parent
    return "-"


ISLANDS = ("dense/norm.py", "dense/cross_entropy.py", "dispatch/permutation.py", "moe/router.py", "moe/scoring.py",
           "dense/attention", "dense/core_attention.py")


def category(inside: str, frame: str) -> str:
    """What a copy is for: the param sync, a weight gradient widened into the fp32 main grad, an activation cast
    into or out of an fp32 island (issue 37's: norms, attention, router, combine, cross entropy; in backward the
    autograd engine's casts of their gradients, attributed to the trainer's backward call), or other."""
    if "optim/optimizer.py" in frame:
        return "param sync (fp32 master -> bf16 parameter, once per step)"
    if any(f in frame for f in ("grad_accumulation.py", "expert_gemm.py", "optim/grad_sync.py")) \
            or "AccumulateGrad" in inside:
        return "weight gradients widened into the fp32 main grads"
    island_frame = any(f in frame for f in ISLANDS) or "trainer.py" in frame
    if (inside == "aten::_to_copy" and island_frame) or "UnpermuteBackward" in inside:
        return "activation casts of the fp32 islands (and their gradients)"
    return "other (clones, contiguous, pow's copy, logging)"


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
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for ms, n, _shape, inside, frame in rows:
        kind = by_kind[category(inside, frame)]
        kind[0] += ms
        kind[1] += n
    print(f"# {label}: the copies by kind (sums of the callers' medians):")
    for kind, (ms, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"#   {ms:7.1f} ms x{n:<5d} {kind}")


__all__ = ["category", "copy_callers", "print_copy_callers"]
