"""The step-time model's end-to-end constants (``step_terms.Calibration``), fitted on part of the published runs.

    python -m moefold.planner.calibration     # fit on the rows marked ``fitted``, print the constants

The fit takes each fitted row of ``planner.published`` apart once: its step as the uncalibrated model times it
(compute with the bubble, exposed communication) and the seconds one second of ``Calibration.layer_seconds`` adds
(the critical rank's blocks times its micro-batches, with what the bubble grows by); the measured step is
``tokens per step / (measured tokens/s/GPU x GPUs)`` (an MFU row scales the same way). It then takes the constants
whose predicted steps ``compute x C + communication x K + host x L`` have the least sum of squared log errors, on a
grid (``GRID``). The linear split is the
surrogate the fit searches; the errors ``python -m moefold.planner.published`` prints are those of the full model
with the constants applied (the pipeline clock re-simulated).

Only the rows marked ``fitted`` (at most half of the table: ``MAX_FITTED_SHARE``) enter the fit; every other row is
held out, and its error is what the model is worth on a run it was not tuned on.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from moefold.planner.published import PUBLISHED_RUNS, PublishedRun
from moefold.planner.step_terms import COMM_TERMS, UNCALIBRATED, Calibration

MAX_FITTED_SHARE = 0.5
# the grid searched: (compute, communication, layer_seconds)
GRID = (np.arange(0.50, 3.0001, 0.01), np.arange(0.20, 4.0001, 0.02), np.arange(0.0, 0.0100001, 0.0001))


@dataclass(frozen=True)
class Split:
    """One run's step in the surrogate's terms: seconds of compute (with the bubble), of exposed communication, of
    host-bound time per second of ``layer_seconds``, and the measured step."""

    compute: float
    communication: float
    host: float
    measured: float


def split(run: PublishedRun) -> Split:
    """``run``'s uncalibrated step, taken apart (module docstring)."""
    plain = run.step_time(calibration=UNCALIBRATED)
    unit = run.step_time(calibration=Calibration(layer_seconds=1e-3))
    comm = sum(plain.terms[t] for t in COMM_TERMS)
    estimate = plain.tokens_per_s_per_gpu if run.metric != "MFU" else plain.flops_per_gpu / plain.total
    measured_rate = run.measured if run.metric != "MFU" else run.measured * run.cluster_peak_flops()
    return Split(compute=plain.total - comm, communication=comm, host=max(unit.total - plain.total, 0.0) / 1e-3,
                 measured=plain.total * estimate / measured_rate)


def fit(runs: tuple[PublishedRun, ...] = PUBLISHED_RUNS) -> Calibration:
    """The constants fitted on ``runs``' fitted rows (ValueError when more than half of them are marked)."""
    fitted = [r for r in runs if r.fitted]
    if not fitted or len(fitted) > MAX_FITTED_SHARE * len(runs):
        raise ValueError(f"{len(fitted)} of {len(runs)} published rows are marked fitted: mark between 1 and "
                         f"{int(MAX_FITTED_SHARE * len(runs))}")
    parts = [split(r) for r in fitted]
    c = np.array([p.compute for p in parts])
    k = np.array([p.communication for p in parts])
    r = np.array([p.host for p in parts])
    y = np.log(np.array([p.measured for p in parts]))
    a, b, d = GRID
    base = a[:, None, None] * c + b[None, :, None] * k          # [A, B, rows]
    best, best_cost = (1.0, 1.0, 0.0), math.inf
    for dv in d:
        cost = ((np.log(base + dv * r) - y) ** 2).sum(axis=-1)
        i, j = np.unravel_index(np.argmin(cost), cost.shape)
        if cost[i, j] < best_cost:
            best, best_cost = (float(a[i]), float(b[j]), float(dv)), float(cost[i, j])
    return Calibration(compute=round(best[0], 2), communication=round(best[1], 2), layer_seconds=round(best[2], 4))


def main() -> int:
    cal = fit()
    print(f"CALIBRATION = Calibration(compute={cal.compute}, communication={cal.communication}, "
          f"layer_seconds={cal.layer_seconds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
