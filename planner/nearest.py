"""Why ``moefold plan`` found nothing, and the nearest layouts that would work.

When the sizes the user fixed leave no valid layout (``--gpus 6 --tensor-model-parallel-size 4``), the reason is
``training.cli.layout_errors.explain``'s (the sizes the model allows, the world the flags need), and the nearest
alternatives are planned: the same fixed sizes on the nearest GPU count that takes them, and on this GPU count each
fixed size moved to the nearest value that works. When layouts are valid but none fits in memory, the closest one is
the report's (``why_not``: how many GB over, and the largest component).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moefold.parallel.dims import ParallelConfig
from moefold.planner.candidates import Fixed
from moefold.planner.report import rejections
from moefold.planner.search import SearchResult
from moefold.training.cli.layout_errors import FLAGS, explain, world_valid_sizes
from moefold.training.config import RunConfig

KEYS = ("tp", "cp", "pp", "ep", "etp")


@dataclass(frozen=True)
class Alternative:
    """A layout near the one asked for: the flags that change, the GPUs and what is fixed there."""

    flags: str
    world: int
    fixed: Fixed


def _fixed_config(config: RunConfig, fixed: Fixed) -> RunConfig:
    sizes = {k: getattr(fixed, k) or 1 for k in KEYS}
    return dataclasses.replace(config, parallel=ParallelConfig(**sizes))


def why_nothing_is_valid(config: RunConfig, fixed: Fixed, world: int, result: SearchResult | None) -> str | None:
    """One line: why no layout of ``world`` GPUs with the ``fixed`` sizes is one ``moefold train`` accepts (None:
    the sizes are not the reason, and there is no search to summarise)."""
    reason = explain(_fixed_config(config, fixed), world, f"--gpus {world}", world_flag="--gpus")
    if reason or result is None:
        return reason
    return f"every layout was refused: {rejections(result)}"


def alternatives(config: RunConfig, fixed: Fixed, world: int) -> list[Alternative]:
    """The nearest layouts to try: the fixed sizes on the nearest GPU count that takes them (more GPUs), and on
    ``world`` each fixed size at the nearest valid value (the others as fixed)."""
    given = {k: getattr(fixed, k) or 1 for k in KEYS}
    need = given["pp"] * math.lcm(given["tp"] * given["cp"], given["ep"] * given["etp"])
    shown = " ".join(f"{FLAGS[k]} {getattr(fixed, k)}" for k in KEYS if getattr(fixed, k))
    out = []
    bigger = -(-world // need) * need
    if bigger != world and not explain(_fixed_config(config, fixed), bigger, ""):
        out.append(Alternative(f"--gpus {bigger} {shown}".strip(), bigger, fixed))
    cfg = _fixed_config(config, fixed)
    for key in KEYS:
        value = getattr(fixed, key)
        if not value:
            continue
        valid = [v for v in world_valid_sizes(cfg, given, key, world) if v != value]
        if not valid:
            continue
        nearest = min(valid, key=lambda v: (abs(v - value), -v))
        moved = dataclasses.replace(fixed, **{key: nearest})
        text = " ".join(f"{FLAGS[k]} {getattr(moved, k)}" for k in KEYS if getattr(moved, k))
        out.append(Alternative(f"--gpus {world} {text}", world, moved))
    return out
