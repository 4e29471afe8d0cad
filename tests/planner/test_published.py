"""The step-time model against published runs: held-out rows within the bound, constants fitted on at most half."""

from __future__ import annotations

import dataclasses

import pytest

from moefold.planner import calibration
from moefold.planner.published import HELD_OUT_BOUND, PUBLISHED_RUNS, error, render_table
from moefold.planner.step_terms import CALIBRATION, Calibration, host_waits


def test_table_has_every_field_and_at_most_half_fitted() -> None:
    assert len(PUBLISHED_RUNS) >= 12
    for run in PUBLISHED_RUNS:
        assert run.source and run.system and run.precision and run.layout and run.measured > 0, run.name
    fitted = sum(run.fitted for run in PUBLISHED_RUNS)
    assert 1 <= fitted <= calibration.MAX_FITTED_SHARE * len(PUBLISHED_RUNS)
    too_many = tuple(dataclasses.replace(r, fitted=True) for r in PUBLISHED_RUNS)
    with pytest.raises(ValueError, match="marked fitted"):
        calibration.fit(too_many)


def test_held_out_rows_within_bound() -> None:
    rows = [(run, run.estimate()) for run in PUBLISHED_RUNS]
    held = {run.name: error(run, est) for run, est in rows if not run.fitted}
    assert held and all(abs(e) <= HELD_OUT_BOUND for e in held.values()), held
    assert "held out" in render_table(rows)


def test_calibration_is_the_fit() -> None:
    """The constants in step_terms are what the fit on the marked rows gives (re-fit after changing either)."""
    assert calibration.fit() == CALIBRATION


def test_host_time_only_where_the_host_waits() -> None:
    """``Calibration.layer_seconds`` adds host-bound time per block and micro-batch, except where CUDA graphs replay
    the MoE preprocess (the device-to-host sync the host would wait on)."""
    eager = next(r for r in PUBLISHED_RUNS if r.name.startswith("Qwen3-30B-A3B, 16 DGX-H100") and r.fitted)
    graphed = next(r for r in PUBLISHED_RUNS if r.name.startswith("Qwen3-30B-A3B, 8 DGX-B200"))
    assert host_waits(eager.config()) and not host_waits(graphed.config())
    for run, adds in ((eager, True), (graphed, False)):
        plain = run.step_time(Calibration()).total
        host = run.step_time(Calibration(layer_seconds=1e-3)).total
        assert (host > plain * (1 + 1e-3)) == adds
    attn_only = dataclasses.replace(graphed.config().train, cuda_graph_modules=("attn",))
    assert host_waits(dataclasses.replace(graphed.config(), train=attn_only))
