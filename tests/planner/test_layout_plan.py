"""The planner with ``--pipeline-model-parallel-layout``: NVIDIA's published DeepSeek-V3 layout on 1024 H100
(TP2 x PP8 x VP4 x EP64) fits and is reported per stage, the standard layouts it searches per pp x vpp contain the
published ones, the printed train command carries the layout back, and a bad layout is refused with its reason."""

from __future__ import annotations

import pytest

from moefold.parallel.dims import ParallelConfig
from moefold.planner.candidates import Fixed, stage_splits
from moefold.planner.cluster import CLUSTERS
from moefold.planner.report import train_flags
from moefold.planner.search import stage_memory
from moefold.training import cli
from moefold.training.cli.train import config_from_args
from tests.planner.test_search import GB80, least_fitting, run_config

DSV3 = "Et|(tt|)*30mL"


@pytest.fixture(scope="module")
def deepseek_plan():
    config = run_config("deepseek_v3", ParallelConfig(tp=2, pp=8, ep=64), 1024, pipeline_model_parallel_layout=DSV3)
    return least_fitting(config, 1024, "h100")


def test_published_deepseek_v3_layout_fits_1024_h100_with_memory_per_stage(deepseek_plan) -> None:
    plan = deepseek_plan
    assert plan.fits and plan.vpp == 4 and plan.memory.static.exact
    stages = stage_memory(plan)
    assert [m.pp_rank for m in stages] == list(range(8))
    assert max(m.total for m in stages) == plan.memory.total <= CLUSTERS["h100"].memory_bytes
    # rank 7 holds the loss and MTP's stage ("mL"), with the output head, the MTP block and its embedding copy
    assert max(stages, key=lambda m: m.static.params).pp_rank == 7
    assert plan.memory.total <= GB80


def test_printed_command_carries_the_layout(deepseek_plan) -> None:
    flags = train_flags(deepseek_plan, ["--recipe", "deepseek_v3"])
    assert flags[flags.index("--pipeline-model-parallel-layout") + 1] == DSV3
    args = cli.build_parser("train").parse_args(["train", *map(str, flags)])
    parsed = config_from_args(args)
    assert parsed.pipeline_layout(8).stages == deepseek_plan.config.pipeline_layout(8).stages


def test_searched_layouts_include_the_published_ones() -> None:
    dsv3 = [s["pipeline_model_parallel_layout"] for s in stage_splits(61, 8, Fixed(virtual_stages=4), 1)]
    qwen = [s["pipeline_model_parallel_layout"] for s in stage_splits(94, 8, Fixed(virtual_stages=4), 0)]
    assert DSV3 in dsv3 and "Ett|(t*3|)*30ttL" in qwen
    every = list(stage_splits(61, 8, Fixed(), 1))   # vpp 1, 2 and 4
    assert {len(s["pipeline_model_parallel_layout"].split("|")) > 8 for s in every} == {True, False}


@pytest.mark.parametrize("layout,reason", [
    ("Et|(tt|)*29t|mL", "holds 60 x 't'; it must hold num_layers=61"),
    ("Et|(tt|)*30L", "mtp_num_layers=1 MTP layers"),
    ("Et|(tt|)*30mL|", "33 virtual stages, not a multiple of pp=8"),
])
def test_a_bad_layout_is_refused_with_its_reason(layout, reason, capsys) -> None:
    code = cli.main(["plan", "--recipe", "deepseek_v3", "--gpus", "1024", "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "8", "--expert-model-parallel-size", "64",
                     "--pipeline-model-parallel-layout", layout])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and reason in err[0], err


def test_an_uneven_even_split_points_to_the_layouts(capsys) -> None:
    code = cli.main(["plan", "--recipe", "deepseek_v3", "--gpus", "1024", "--pipeline-model-parallel-size", "8",
                     "--num-layers-per-virtual-pipeline-stage", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--num-virtual-stages-per-pipeline-rank 4" in err, err
