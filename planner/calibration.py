"""The step-time model's end-to-end constants (``step_terms.Calibration``), fitted on part of the published runs.

    python -m moefold.planner.calibration     # fit on the rows marked ``fitted``, print the constants
    python -m moefold.planner.calibration --power-exponents 0,0.58,1   # and the fit at other board-power laws

The fit takes each fitted row of ``planner.published`` apart once: its step as the uncalibrated model times it, in
the parts each constant scales (the single GEMMs, which no constant scales; the grouped expert GEMMs; the rest of the
compute; exposed communication; each with what the bubble grows by) and the seconds one second of
``Calibration.layer_seconds`` adds (the critical rank's blocks times its micro-batches); the measured step is
``tokens per step / (measured tokens/s/GPU x GPUs)`` (an MFU row scales the same way). A part is what doubling its
constant adds to the uncalibrated step. The fit then takes the constants whose predicted steps
``single + grouped x G + other x O + communication x K + host x L`` have the least sum of squared log errors, on a
grid refined once around its best point (``GRIDS``). The linear split is the surrogate the fit searches; the errors
``python -m moefold.planner.published`` prints are those of the full model with the constants applied (the pipeline
clock re-simulated).

Only the rows marked ``fitted`` (at most half of the table: ``MAX_FITTED_SHARE``) enter the fit; every other row is
held out, and its error is what the model is worth on a run it was not tuned on.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass

import numpy as np

from moefold.planner.cluster import Cluster, load_cluster
from moefold.planner.gemm_efficiency import FIT_GPU, POWER_EXPONENT
from moefold.planner.published import PUBLISHED_RUNS, PublishedRun
from moefold.planner.step_terms import UNCALIBRATED, Calibration

MAX_FITTED_SHARE = 0.5
# (grouped, other, communication, layer_seconds): the coarse grid (low, high, step), then a finer one centred on its
# best point (half-width, step) per constant; the constants are rounded to the finest steps
GRIDS = (((0.3, 6.0, 0.1), (0.3, 3.0, 0.1), (0.2, 4.0, 0.1), (0.0, 0.01, 0.0005)),
         ((0.1, 0.01), (0.1, 0.01), (0.1, 0.02), (0.0005, 0.0001)))


@dataclass(frozen=True)
class Split:
    """One run's step in the surrogate's terms: seconds of single GEMMs (with the bubble they cause and everything no
    constant scales), of grouped expert GEMMs, of the rest of the compute, of exposed communication, of host-bound
    time per second of ``layer_seconds``, and the measured step."""

    single: float
    grouped: float
    other: float
    communication: float
    host: float
    measured: float

    def predicted(self, grouped: float, other: float, communication: float, layer_seconds: float) -> float:
        return (self.single + grouped * self.grouped + other * self.other + communication * self.communication
                + layer_seconds * self.host)


def split(run: PublishedRun, cluster: Cluster | None = None) -> Split:
    """``run``'s uncalibrated step, taken apart (module docstring); ``cluster``: in place of the run's preset."""
    plain = run.step_time(UNCALIBRATED, cluster)
    grouped = run.step_time(Calibration(grouped=2.0), cluster).total - plain.total
    other = run.step_time(Calibration(other=2.0), cluster).total - plain.total
    comm = run.step_time(Calibration(communication=2.0), cluster).total - plain.total
    unit = run.step_time(Calibration(layer_seconds=1e-3), cluster)
    estimate = plain.tokens_per_s_per_gpu if run.metric != "MFU" else plain.flops_per_gpu / plain.total
    measured_rate = run.measured if run.metric != "MFU" else run.measured * run.cluster_peak_flops()
    return Split(single=plain.total - grouped - other - comm, grouped=grouped, other=other, communication=comm,
                 host=max(unit.total - plain.total, 0.0) / 1e-3, measured=plain.total * estimate / measured_rate)


def _best(parts: list[Split], axes: list[np.ndarray]) -> tuple[tuple[float, ...], float]:
    """The grid point (one value per constant from ``axes``) of least squared log error over ``parts``, and that
    error."""
    cols = np.array([[p.single, p.grouped, p.other, p.communication, p.host] for p in parts])   # [rows, 5]
    y = np.log(np.array([p.measured for p in parts]))
    g, o, k, d = (a.reshape(shape) for a, shape in zip(axes, ((-1, 1, 1, 1), (1, -1, 1, 1), (1, 1, -1, 1),
                                                             (1, 1, 1, -1))))
    best, best_cost = None, math.inf
    for row_g in g:   # one grouped value at a time keeps the arrays small
        pred = (cols[:, 0] + row_g[..., None] * cols[:, 1] + o[..., None] * cols[:, 2] + k[..., None] * cols[:, 3]
                + d[..., None] * cols[:, 4])
        cost = ((np.log(np.maximum(pred, 1e-12)) - y) ** 2).sum(axis=-1)
        i = np.unravel_index(np.argmin(cost), cost.shape)
        if cost[i] < best_cost:
            best_cost = float(cost[i])
            best = (float(row_g.ravel()[0]), float(o.ravel()[i[1]]), float(k.ravel()[i[2]]), float(d.ravel()[i[3]]))
    return best, best_cost


def _fitted(runs: tuple[PublishedRun, ...]) -> list[PublishedRun]:
    fitted = [r for r in runs if r.fitted]
    if not fitted or len(fitted) > MAX_FITTED_SHARE * len(runs):
        raise ValueError(f"{len(fitted)} of {len(runs)} published rows are marked fitted: mark between 1 and "
                         f"{int(MAX_FITTED_SHARE * len(runs))}")
    return fitted


def _fit_parts(parts: list[Split]) -> tuple[Calibration, float]:
    """The constants of least squared log error over ``parts`` (the grids of ``GRIDS``), and that error."""
    coarse, *finer = GRIDS
    best, cost = _best(parts, [np.arange(lo, hi + step / 2, step) for lo, hi, step in coarse])
    for grid in finer:
        best, cost = _best(parts, [np.arange(max(step, c - half), c + half + step / 2, step) if i < 3 else
                                   np.arange(max(0.0, c - half), c + half + step / 2, step)
                                   for i, (c, (half, step)) in enumerate(zip(best, grid))])
    g, o, k, d = best
    return Calibration(grouped=round(g, 2), other=round(o, 2), communication=round(k, 2),
                       layer_seconds=round(d, 4)), cost


def fit(runs: tuple[PublishedRun, ...] = PUBLISHED_RUNS) -> Calibration:
    """The constants fitted on ``runs``' fitted rows (ValueError when more than half of them are marked)."""
    return _fit_parts([split(r) for r in _fitted(runs)])[0]


def at_power_exponent(cluster: Cluster, exponent: float) -> Cluster:
    """``cluster`` with its board power restated so that ``gemm_efficiency.tensor_tflops`` scales its sustained rate
    as (board power / the fit GPU's) ** ``exponent`` in place of ** ``POWER_EXPONENT`` (itself where that does not
    apply: no board power, or an architecture without a fit GPU)."""
    fit_gpu = FIT_GPU.get(cluster.arch)
    if not cluster.board_watts or fit_gpu is None:
        return cluster
    ratio = (cluster.board_watts / fit_gpu[2]) ** (exponent / POWER_EXPONENT)
    return dataclasses.replace(cluster, board_watts=fit_gpu[2] * ratio)


def power_exponent_fits(exponents: tuple[float, ...],
                        runs: tuple[PublishedRun, ...] = PUBLISHED_RUNS) -> dict[float, tuple[Calibration, float]]:
    """Per exponent of the board-power law (``gemm_efficiency.POWER_EXPONENT``): the constants fitted on ``runs``'
    fitted rows with that law, and the root-mean-square log error of those rows in the fit's surrogate. What the
    law's exponent rests on beside physics: 0 runs every Blackwell GPU at the B200's measured rate, the datasheets'
    own B200 -> GB200 step (2,250 -> 2,500 TFLOP/s for 1,000 -> 1,200 W) is 0.58, 1 is a clock in proportion to
    power."""
    fitted = _fitted(runs)
    out = {}
    for exponent in exponents:
        parts = [split(r, at_power_exponent(load_cluster(r.cluster), exponent)) for r in fitted]
        cal, cost = _fit_parts(parts)
        out[exponent] = cal, math.sqrt(cost / len(parts))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moefold.planner.calibration", allow_abbrev=False,
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--power-exponents", default="", metavar="A,B,...",
                        help="also fit with these exponents of the board-power law and print each fit's error on the "
                             "fitted rows (e.g. 0,0.58,1)")
    args = parser.parse_args(argv)
    try:
        exponents = tuple(float(x) for x in args.power_exponents.split(",")) if args.power_exponents else ()
    except ValueError:
        parser.error(f"--power-exponents {args.power_exponents!r}: give numbers separated by commas, e.g. 0,0.58,1")
    cal = fit()
    print(f"CALIBRATION = Calibration(grouped={cal.grouped}, other={cal.other}, communication={cal.communication}, "
          f"layer_seconds={cal.layer_seconds})")
    for exponent, (c, rms) in power_exponent_fits(exponents).items():
        print(f"power exponent {exponent:g}: rms log error of the fitted rows {rms:.4f} with {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
