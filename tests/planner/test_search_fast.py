"""The search's caches change no answer: its ranked layouts and their numbers (memory by component, step time by
term) equal those of the search before them (6c9499b: every bound, memory and step time computed per layout),
saved in ``tests/planner/data/search_*.json`` by ``benchmarks/plan_reference.py`` (the ``moefold plan`` flags are in
each file). The caches were held to 6c9499b's files; the files were written again on the merge that changed the
memory and step-time models on purpose (issue 46: norms, router and FP8 SwiGLU activations; Blackwell GEMM fit,
host-bound time; the board-power law's refit): rerun ``benchmarks/plan_reference.py`` with each file's flags after
such a change, never to make a cache pass. What they cache: per block kind the compute and the unhidden
communication of the step-time bound (``planner.step_bound``), per context the chunks' actions
(``planner.chunk_cache``), per layout the activations whatever shards the static memory (``planner.profile``), per
stage the parameter counts (``planner.static``).

Qwen3-30B-A3B on 8 GPUs runs in the default suite (a few seconds); on 64 GPUs and DeepSeek-V3 on 256 they are marked
slow (10-40 s of CPU each).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
REL = 1e-9   # the caches add the same terms in another order at most: float rounding, not a model change


def _search(argv: list[str]) -> list[dict]:
    import benchmarks.plan_reference as reference

    return [reference.plan_record(plan) for plan in reference.search_result(argv).plans]


def _same(got: dict, want: dict) -> list[str]:
    """The differences between two plan records (``plan_reference.plan_record``)."""
    out = [f"{k}: {got[k]!r} != {want[k]!r}" for k in want if k not in ("memory", "time") and got[k] != want[k]]
    for section in ("memory", "time"):
        for k, v in want[section].items():
            if not math.isclose(got[section][k], v, rel_tol=REL, abs_tol=1e-12):
                out.append(f"{section} {k}: {got[section][k]!r} != {v!r}")
    return out


def _check(name: str) -> None:
    saved = json.loads((DATA / name).read_text())
    plans = _search(saved["argv"])
    assert len(plans) == len(saved["plans"])
    for n, (got, want) in enumerate(zip(plans, saved["plans"])):
        assert not _same(got, want), f"#{n + 1}: " + "; ".join(_same(got, want))


def test_qwen3_30b_on_8_gpus_ranks_as_before() -> None:
    _check("search_qwen3_30b_8.json")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["search_qwen3_30b_64.json", "search_deepseek_v3_256.json"])
def test_larger_searches_rank_as_before(name: str) -> None:
    _check(name)


def test_a_changed_number_is_seen() -> None:
    """The comparison can fail: one term off by 1e-6 of itself is a difference."""
    saved = json.loads((DATA / "search_qwen3_30b_8.json").read_text())["plans"][0]
    changed = json.loads(json.dumps(saved))
    changed["time"]["compute"] *= 1 + 1e-6
    changed["schedule"] = "1f1b"
    assert len(_same(changed, saved)) == 2
