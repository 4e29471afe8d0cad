"""Layout errors that say what would be valid: the sizes the model allows for the flag that failed, and the world
the flags need, with the defaults they assume.

    --tensor-model-parallel-size=3 does not split qwen3_moe_tiny: num_heads=4 is not divisible by tp=3; valid for
    this model: 1, 2 or 4
    --tensor-model-parallel-size=2 needs a multiple of 2 ranks (tp 2 x cp 1 x pp 1), but the world has 1 rank
    (--nproc 1, the default): use --nproc 2

``explain(config, world, world_source)`` checks the model-side constraints first, one size flag at a time in the
order tp, cp, ep, etp (each with the flags before it as given), so the message blames the flag that cannot work
for this model whatever the world; then the world. The valid sizes come from the same checks ``moefold train``
applies (``RunConfig.resolve``'s sequence checks and ``models.layer_factory.check_layout``), tried value by value,
so the list never disagrees with what a run accepts.
"""

from __future__ import annotations

import math
import re

from moefold.training.config import RunConfig

FLAGS = {"tp": "--tensor-model-parallel-size", "cp": "--context-parallel-size", "pp": "--pipeline-model-parallel-size",
         "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size"}
MODEL_SIZES = ("tp", "cp", "ep", "etp")   # what the model itself constrains (pp: the pipeline split's messages)
MAX_SIZE = 1024
MAX_LISTED = 16
SP_NOTE = "sequence parallelism, on by default with tp > 1; --no-sequence-parallel turns it off"


def _or_list(values: list[int]) -> str:
    if len(values) > MAX_LISTED:
        values = [*values[:MAX_LISTED - 1], "...", values[-1]]
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def model_reasons(config: RunConfig, sizes: dict[str, int]) -> list[str]:
    """Why ``config``'s model and sequence cannot be split into ``sizes`` (tp, cp, ep, etp) at any world; empty
    when they can."""
    from moefold.models.layer_factory import check_layout
    from moefold.parallel.dims import ParallelConfig, ParallelDims

    tp, cp, ep, etp = (sizes.get(k, 1) for k in MODEL_SIZES)
    seq = config.train.seq_length
    reasons = []
    if cp > 1 and seq % (2 * cp):
        reasons.append(f"--seq-length={seq} is not divisible by 2 x cp={cp} (each rank holds two chunks of every "
                       "sequence)")
    elif config.options.sequence_parallel and tp > 1 and (seq // cp) % tp:
        reasons.append(f"--seq-length={seq}{f' / cp {cp}' if cp > 1 else ''} is not divisible by tp={tp} "
                       f"({SP_NOTE})")
    dp = math.lcm(tp * cp, ep * etp) // (tp * cp)   # any world where the expert layout fits the stage's ranks
    try:
        layout = ParallelConfig(tp=tp, cp=cp, pp=1, ep=ep, etp=etp).resolve(tp * cp * dp)
        check_layout(config.model, ParallelDims(sizes=layout), config.options)
    except ValueError as exc:
        reasons.append(re.sub(r"^\w+Config: ", "", str(exc)))
    return reasons


def valid_sizes(config: RunConfig, sizes: dict[str, int], key: str, limit: int = MAX_SIZE) -> list[int]:
    """The values of ``key`` the model allows, the other ``sizes`` as given."""
    return [v for v in range(1, limit + 1) if not model_reasons(config, {**sizes, key: v})]


def world_source(nproc: int, torchrun: bool) -> str:
    """How the run got its world, for the messages."""
    if torchrun:
        return "WORLD_SIZE from torchrun"
    return "--nproc 1, the default" if nproc == 1 else f"--nproc {nproc}"


def explain(config: RunConfig, world: int, source: str, world_flag: str = "--nproc") -> str | None:
    """The message for a layout of ``config.parallel`` that ``moefold train`` cannot run on ``world`` ranks (got
    from ``source``, e.g. ``--nproc 1, the default``), or None when the sizes this module checks are all valid."""
    p = config.parallel
    given = {"tp": p.tp, "cp": p.cp, "pp": p.pp, "ep": p.ep, "etp": p.etp}
    bad = [f"{FLAGS[k]}={v}" for k, v in given.items() if not isinstance(v, int) or v < 1]
    if bad:
        return f"{', '.join(bad)}: sizes are positive integers"
    prefix: dict[str, int] = {}
    for key in MODEL_SIZES:
        prefix[key] = given[key]
        if given[key] == 1:
            continue
        reasons = model_reasons(config, prefix)
        if reasons:
            others = ", ".join(f"{FLAGS[k]}={v}" for k, v in prefix.items() if k != key and v != 1)
            valid = valid_sizes(config, prefix, key)
            return (f"{FLAGS[key]}={given[key]} does not split {config.model.name}: {'; '.join(reasons)}; valid for "
                    f"this model and --seq-length{' with ' + others if others else ''}: {_or_list(valid)}")
    tp, cp, pp, ep, etp = (given[k] for k in ("tp", "cp", "pp", "ep", "etp"))
    need = pp * math.lcm(tp * cp, ep * etp)   # the smallest world: tp*cp*pp divides it, ep*etp each stage's ranks
    if world % (tp * cp * pp) == 0 and (world // pp) % (ep * etp) == 0:
        return None
    dense = " x ".join(f"{k} {given[k]}" for k in ("tp", "cp", "pp") if given[k] > 1)
    expert = f"ep {ep} x etp {etp} dividing the ranks of each pipeline stage" if ep * etp > 1 else ""
    nearest = -(-world // need) * need
    fix = f"use {world_flag} {nearest}" + (f" (or a multiple of {need})" if nearest != need else "")
    fits = [f"{FLAGS[k]} {_or_list(v)}" for k in ("tp", "cp", "ep", "etp") if given[k] > 1
            for v in [world_valid_sizes(config, given, k, world)] if v and v != [1]]
    also = f", or on {world}: {'; '.join(fits)}" if fits else ""
    named = [f"{FLAGS[k]}={given[k]}" for k in given if given[k] > 1]
    ranks = "rank" if world == 1 else "ranks"
    return (f"{' and '.join(named)} need{'s' if len(named) == 1 else ''} a multiple of {need} ranks "
            f"({'; '.join(x for x in (dense, expert) if x)}), but the world has {world} {ranks} ({source}): "
            f"{fix}{also}")


def world_valid_sizes(config: RunConfig, given: dict[str, int], key: str, world: int) -> list[int]:
    """The values of ``key`` valid for the model that also fit ``world`` with the other sizes as given."""
    out = []
    for v in valid_sizes(config, {k: given[k] for k in MODEL_SIZES}, key, limit=world):
        s = {**given, key: v}
        if world % (s["tp"] * s["cp"] * s["pp"]) == 0 and (world // s["pp"]) % (s["ep"] * s["etp"]) == 0:
            out.append(v)
    return out
