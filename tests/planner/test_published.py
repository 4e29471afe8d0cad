"""The step-time model against published runs: held-out rows within the bound, constants fitted on at most half."""

from __future__ import annotations

import dataclasses

import pytest

from moefold.planner import calibration
from moefold.planner.published import HELD_OUT_BOUND, PUBLISHED_RUNS, error, render_table
from moefold.planner.step_terms import CALIBRATION


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
