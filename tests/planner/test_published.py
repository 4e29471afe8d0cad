"""The step-time model against published runs: held-out rows within the bound, constants fitted on at most half."""

from __future__ import annotations

import dataclasses

import pytest

from moefold.planner import calibration
from moefold.planner.breakdown import KINDS, breakdown_row, compute_split
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


def test_compute_split_adds_up_to_the_compute_term() -> None:
    """A row's split (single and grouped GEMMs, core attention, elementwise, host-bound) is the compute term's share
    of the step, only the eager row has host-bound time, and the breakdown's seconds add up to the model's step."""
    for run in (PUBLISHED_RUNS[2], PUBLISHED_RUNS[7]):   # Qwen3-30B-A3B on 16 H100 eager, on 8 B200 with CUDA graphs
        st = run.step_time()
        split = compute_split(run)
        assert tuple(split) == KINDS and min(split.values()) >= 0
        assert sum(split.values()) == pytest.approx(st.terms["compute"] / st.total, rel=1e-9)
        assert (split["host-bound"] > 0) == host_waits(run.config())
        assert split["grouped GEMMs"] > split["core attention"] > 0 and split["elementwise"] > 0
        assert split["single GEMMs"] > 0
        row = breakdown_row(run)
        parts = sum(row[k] for k in (*KINDS, "communication", "bubble", "offload"))
        assert parts == pytest.approx(row["model"], rel=1e-9)
        assert row["error"] == pytest.approx(row["measured"] / row["model"] - 1, rel=1e-9)


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


@pytest.mark.parametrize("row", range(1, len(PUBLISHED_RUNS) + 1))
def test_published_row_fits_its_gpu(row: int) -> None:
    """A published run is proof its layout fit: the plan's fullest stage needs at most the GPU's memory."""
    run = PUBLISHED_RUNS[row - 1]
    memory = run.memory()
    assert memory.total <= run.gpu_memory(), (f"{run.name}: {memory.total / 1e9:.1f} GB of "
                                             f"{run.gpu_memory() / 1e9:.0f} GB, largest {memory.largest}")


def test_interleaved_rows_hold_megatrons_warmup() -> None:
    """The in-flight (micro-batch, chunk) pairs of every interleaved published row are Megatron-Core 0.16.1's
    (``schedules.get_pp_rank_microbatches``): ``(pp - rank - 1) * 2 + (vp - 1) * pp`` warm-up forwards (+1 with
    ``overlap_moe_expert_parallel_comm``), then the steady step's forward: that many plus one held."""
    from moefold.planner.inflight import held_states, most_held
    from moefold.planner.static import layout_of
    from moefold.training.cli.train import validate_layout

    checked = 0
    for run in PUBLISHED_RUNS:
        config = run.config()
        sizes = validate_layout(config, run.gpus)
        vpp = layout_of(config, sizes.pp).vpp if sizes.pp > 1 else 1
        if vpp == 1 or config.schedule_name(vpp) != "interleaved":   # the report row: DualPipeV
            continue
        _, m = config.resolve(run.gpus)
        overlap = config.train.overlap_moe_expert_parallel_comm
        for rank in range(sizes.pp):
            warmup = min((sizes.pp - rank - 1) * 2 + (vpp - 1) * sizes.pp + int(overlap), m * vpp)
            states = held_states(config.schedule_name(vpp), sizes.pp, vpp, m, rank)
            # the states count an FB step's forward pair; its backward pair is the + int(overlap)
            assert most_held(states) + int(overlap) == warmup + 1, (run.name, rank)
        checked += 1
    assert checked >= 5
