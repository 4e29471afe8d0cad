"""Routing imbalance against the memory plan: the observed max/mean expert load next to ``--moe-max-load-ratio``.

``moefold plan --moe-max-load-ratio R`` sizes the routed experts' activations for the worst expert receiving R x
its share of a micro-batch's copies (dropless; ``planner.activations_ffn.moe_rows``). The run given the same
flag measures what that assumption is about: for every micro-batch and MoE layer, the per-expert copies summed
over the dispatch group (the ranks whose tokens go to the same expert instances: etp x ep), max / mean
(``micro_batch_load_ratio``: one all-reduce over that group and one MAX over the world per step, of the step's
[micro-batches, layers, E] counts on the device). ``LoadRatioWatch`` prints once when a step comes within 10% of R
(before it is exceeded) and once when it exceeds R; the metrics line and ``metrics.jsonl`` carry both numbers.

A step's summed loads (the metrics line's "load max/mean") are smoother than a micro-batch's; the memory a
micro-batch needs follows the micro-batch's, which is why this is measured per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.groups import Group, group_size

WARN_AT = 0.9   # of the planned ratio: the warning comes before the assumption is exceeded


def check_max_load_ratio(ratio: float | None) -> float | None:
    """``ratio`` if None or >= 1 (max / mean is at least 1), else ValueError naming the flag."""
    if ratio is None:
        return None
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio >= 1.0:
        raise ValueError(f"--moe-max-load-ratio={ratio!r} must be a number >= 1 (the worst expert's load over the "
                         "mean, 1 = perfectly balanced)")
    return float(ratio)


def micro_batch_load_ratio(loads_MLE: Tensor, dispatch_group: Group, world: bool) -> Tensor:
    """The largest max/mean expert load (0-d float64) over the micro-batches and MoE layers of a step.

    ``loads_MLE``: float64 [micro-batches, MoE layers, E] this rank's routed copies (zeros for layers of other
    stages). Collective: an all-reduce over ``dispatch_group`` and, with ``world``, a MAX over the world."""
    loads = loads_MLE.clone()
    if group_size(dispatch_group) > 1:
        dist.all_reduce(loads, group=dispatch_group)
    mean = loads.mean(dim=-1)
    ratio = torch.where(mean > 0, loads.amax(dim=-1) / mean.clamp(min=1e-30), torch.zeros_like(mean))
    worst = ratio.amax() if ratio.numel() else torch.zeros((), dtype=torch.float64, device=loads.device)
    if world:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst


class LoadRatioWatch:
    """Compares each step's observed ratio with the planned one and says so, once each: at ``WARN_AT`` x the plan
    and above it. ``worst``: the largest ratio seen."""

    def __init__(self, planned: float, log: Callable[[str], None]) -> None:
        self.planned = check_max_load_ratio(planned)
        self.log = log
        self.worst = 0.0
        self._near = self._over = False

    def observe(self, step: int, ratio: float) -> None:
        self.worst = max(self.worst, ratio)
        advice = ("raise --moe-max-load-ratio and plan again (moefold plan), strengthen the load balancing, or bound "
                  "the worst case with --moe-expert-rank-capacity-factor")
        if ratio > self.planned and not self._over:
            self._over = self._near = True
            self.log(f"step {step}: a micro-batch's expert load max/mean {ratio:.2f} exceeds the planned "
                     f"--moe-max-load-ratio {self.planned:g}: the routed experts' activations were sized for "
                     f"{self.planned:g} and may not fit; {advice}")
        elif ratio >= WARN_AT * self.planned and not self._near:
            self._near = True
            self.log(f"step {step}: a micro-batch's expert load max/mean {ratio:.2f} is within "
                     f"{100 * (1 - WARN_AT):.0f}% of the planned --moe-max-load-ratio {self.planned:g} the expert "
                     f"activations were sized for; {advice}")
