"""Each schedule's compute order on one pipeline rank: which F / B / I / W / FB runs next (no communication).

- ``gpipe``: all forwards, then all backwards.
- ``1f1b``: ``pp - r - 1`` warm-up forwards, then one forward and one backward in turn, then the rest.
- ``interleaved``: Megatron's interleaved 1F1B over ``vpp`` chunks per rank.
- ``zb-h1``: the zero-bubble schedule ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): 1F1B with
  every backward split into ``I`` (input gradient) and ``W`` (weight gradient); rank r leaves its first ``r``
  ``W`` for the cool-down, where 1F1B idles. Bubble ``(p-1)(F+I-W)`` instead of ``(p-1)(F+B)`` at 1F1B's
  activation memory (torch's ``ScheduleInterleavedZeroBubble`` with one chunk per rank).
- ``zbv``: ZB-V (ibid., section 6; torch's ``ScheduleZBVZeroBubble``): two chunks per rank in V placement
  (``actions.Placement.V``), forward down the first and back up the second, ``W`` filling the gaps:
  no bubble when F = I = W.
- ``dualpipev``: DeepSeek's DualPipe cut in half (DualPipeV, Sea AI Lab; torch's ``ScheduleDualPipeV``, after
  deepseek-ai/DualPipe ``dualpipev.py``): V placement, the steady state pairs a forward of one chunk with the
  full backward of the other as one overlapped ``FB``, zero-bubble ``I``/``W`` in warm-up and cool-down.

``overlap`` (batch-level overlap, ``--overlap-moe-expert-parallel-comm``) turns 1F1B's and interleaved 1F1B's
steady state into ``FB`` pairs. Their two halves must not depend on each other, so one more forward runs in the
warm-up (Megatron does the same), and each pair is the forward of micro-batch j with the backward of an earlier
one. At pp = 1 this is Megatron's combined 1F1B without pipelining: F0, FB(1, 0), ..., FB(m-1, m-2), B(m-1).
"""

from __future__ import annotations

from collections import deque

from moefold.pipeline.actions import Action, ActionKind


def _interleaved_virtual(k: int, kind: str, pp: int, vpp: int) -> Action:
    """Megatron's virtual micro-batch k: micro-batch (k // (pp*vpp)) * pp + k % pp on chunk (k // pp) % vpp
    (the chunks reversed for the backward)."""
    group, pos = divmod(k, pp * vpp)
    chunk = pos // pp
    return Action(kind, group * pp + pos % pp, chunk if kind == "F" else vpp - 1 - chunk)


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int, overlap: bool) -> list[Action]:
    """Warm-up forwards, steady (forward, backward) pairs (``FB`` when overlapping), cool-down backwards."""
    total = len(forwards)
    if overlap:
        warmup = min(warmup + 1, total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        f, b = forwards[warmup + i], backwards[i]
        order += [Action.overlapped(f, b)] if overlap else [f, b]
    return order + backwards[total - warmup:]


def _zb_h1(pp: int, m: int, r: int) -> list[Action]:
    warmup = min(pp - r - 1, m)
    order = [Action(ActionKind.F, i) for i in range(warmup)]
    waiting: deque[int] = deque()
    for k, i in enumerate(range(m)):   # every backward input, steady (with a forward before it) then cool-down
        if warmup + i < m:
            order.append(Action(ActionKind.F, warmup + i))
        order.append(Action(ActionKind.I, i))
        waiting.append(i)
        if k >= r:   # rank r keeps its first r weight gradients for the cool-down
            order.append(Action(ActionKind.W, waiting.popleft()))
    return order + [Action(ActionKind.W, i) for i in waiting]


def _zbv(pp: int, m: int, r: int) -> list[Action]:
    n = max(2 * pp - 1, m)   # as torch: enough micro-batches to fill the V; the extra ones are dropped below
    count = {(c, k): 0 for c in (0, 1) for k in "FIW"}
    order: list[Action] = []

    def add(chunk: int, kinds: str) -> None:
        for kind in kinds:
            order.append(Action(kind, count[(chunk, kind)], chunk))
            count[(chunk, kind)] += 1

    for _ in range(2 * (pp - r) - 1):
        add(0, "F")
    for _ in range(r):
        add(1, "F")
        add(0, "F")
    for _ in range(pp - r):
        add(1, "FIW")
    while count[(1, "F")] < count[(0, "F")] or count[(0, "F")] < n:
        add(0, "FIW" if count[(0, "F")] < n else "IW")
        add(1, "FIW")
    for _ in range(r):
        add(0, "I")
        add(1, "I")
    for _ in range(pp - r):
        add(0, "IW")
    while count[(1, "W")] < count[(1, "I")]:
        add(1, "W")
    while count[(0, "W")] < count[(0, "I")]:
        add(0, "W")
    return [a for a in order if a.microbatch < m]


def _dualpipev(pp: int, m: int, r: int) -> list[Action]:
    forward = {0: 0, 1: 0}
    backward = {0: 0, 1: 0}   # backward-input counter of each chunk (B and I both advance it)
    weights: deque[Action] = deque()   # W of every I not yet run, oldest first
    order: list[Action] = []

    def f(chunk: int) -> Action:
        forward[chunk] += 1
        return Action(ActionKind.F, forward[chunk] - 1, chunk)

    def b(chunk: int, split: bool = False) -> Action:
        backward[chunk] += 1
        mb = backward[chunk] - 1
        if split:
            weights.append(Action(ActionKind.W, mb, chunk))
        return Action(ActionKind.I if split else ActionKind.B, mb, chunk)

    def w() -> None:
        if weights:
            order.append(weights.popleft())

    order += [f(0) for _ in range(2 * (pp - r - 1))]              # 1: F0
    for _ in range(r + 1):                                         # 2: F0 F1
        order += [f(0), f(1)]
    for _ in range(pp - r - 1):                                    # 3: I1 W1 F1 (zero bubble)
        order.append(b(1, split=True))
        w()
        order.append(f(1))
    for i in range(m - 2 * pp + r + 1):                            # 4 (main): F0&B1, F1&B0 overlapped
        if i == 0 and r == pp - 1:   # not overlapped: a shorter bubble (DualPipe's note)
            order += [f(0), b(1)]
        else:
            order.append(Action.overlapped(f(0), b(1)))
        order.append(Action.overlapped(f(1), b(0)))
    for _ in range(pp - r - 1):                                    # 5: B1, F1&B0
        order.append(b(1))
        order.append(Action.overlapped(f(1), b(0)))
    split = False                                                  # 6: B1 B0, the second half zero-bubble
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        order.append(b(1, split))
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        order.append(b(0, split))
    for _ in range(pp - r - 1):                                    # 7: W B0
        w()
        order.append(b(0, split))
    for _ in range(r + 1):                                         # 8: W
        w()
    return order


def compute_order(name: str, pp: int, vpp: int, num_microbatches: int, pp_rank: int,
                  overlap: bool = False) -> list[Action]:
    """The compute order of schedule ``name`` on rank ``pp_rank`` (see the module docstring)."""
    m, r = num_microbatches, pp_rank
    if name == "gpipe":
        return [Action(ActionKind.F, i) for i in range(m)] + [Action(ActionKind.B, i) for i in range(m)]
    if name == "1f1b":
        forwards, backwards = [Action(ActionKind.F, i) for i in range(m)], [Action(ActionKind.B, i) for i in range(m)]
        return _one_f_one_b(forwards, backwards, min(pp - r - 1, m), overlap)
    if name == "interleaved":
        total = m * vpp
        warmup = total if m == pp else min(2 * (pp - r - 1) + (vpp - 1) * pp, total)
        return _one_f_one_b([_interleaved_virtual(k, "F", pp, vpp) for k in range(total)],
                            [_interleaved_virtual(k, "B", pp, vpp) for k in range(total)], warmup, overlap)
    if name == "zb-h1":
        return _zb_h1(pp, m, r)
    if name == "zbv":
        return _zbv(pp, m, r)
    if name == "dualpipev":
        return _dualpipev(pp, m, r)
    raise ValueError(f"unknown schedule {name!r}")
