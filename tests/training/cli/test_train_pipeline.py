"""``moefold train`` with pipeline parallelism: the flags reach the trainer, an interleaved pp2 run works end to
end (2 spawned ranks) and equals world 1, its checkpoint resumes at world 1, and impossible pipeline flags fail
before any rank starts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from moefold.training.build import build_pipeline, micro_batches
from moefold.training.cli import build_parser
from moefold.training.cli import main as cli_main
from moefold.training.cli.train import config_from_args
from moefold.training.data.indexed import IndexedDatasetWriter
from moefold.training.observe.metrics import METRICS_FILE, read_metrics
from tests.training.trainer_common import tiny_data

TOL = 1e-4   # pp2 vs world 1, fp32
BASE = ["train", "--recipe", "deepseek_v3_tiny", "--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--lr-warmup-iters", "1", "--log-interval", "1", "--device", "cpu",
        "--no-balance-report"]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / METRICS_FILE)]


def test_pipeline_train_end_to_end_equals_world_1_and_resumes_at_world_1(tmp_path):
    prefix = tmp_path / "data" / "tiny"
    with IndexedDatasetWriter(prefix, 256) as writer:   # no corpus preparation: fixed learnable samples
        for row in tiny_data(16):
            writer.add_document(row)
    base = [*BASE, "--data-path", str(prefix), "--train-iters", "4"]
    pp2 = ["--nproc", "2", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    save = tmp_path / "ck_pp2"
    assert cli_main([*base, *pp2, "--run-dir", str(tmp_path / "pp2"), "--save", str(save), "--save-interval", "3"]) == 0
    assert cli_main([*base, "--run-dir", str(tmp_path / "w1"), "--no-save"]) == 0
    records = read_metrics(tmp_path / "pp2" / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["moe"]["worst_layer"] is not None for r in records)
    w1 = _losses(tmp_path / "w1")
    assert _losses(tmp_path / "pp2") == pytest.approx(w1, abs=TOL, rel=0)
    # the pp2 checkpoint of step 3 resumes at world 1: its step 4 is world 1's step 4
    assert cli_main([*base, "--load", str(save / "iter_0000003"), "--run-dir", str(tmp_path / "resumed"),
                     "--no-save"]) == 0
    resumed = read_metrics(tmp_path / "resumed" / METRICS_FILE)
    assert [r["step"] for r in resumed] == [4] and resumed[0]["loss"] == pytest.approx(w1[3], abs=TOL, rel=0)


def test_pipeline_schedule_flag_reaches_the_config():
    def config(*flags):
        return config_from_args(build_parser("train").parse_args([*BASE, *flags]))

    assert config().train.pipeline_schedule == "1f1b"          # Megatron's default
    c = config("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe")
    assert c.schedule_name(c.pipeline_layout(2).vpp) == "gpipe"
    c = config("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1")
    assert c.pipeline_layout(2).vpp == 2 and c.schedule_name(2) == "interleaved"
    c = config("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1")
    assert [list(c.pipeline_layout(2).rank_layers(r)) for r in range(2)] == [[0], [1, 2, 3]]


def test_pipeline_line_names_the_placement_only_for_several_chunks_per_rank():
    """The run's pipeline line: zb-h1 (one chunk per rank) is not "vpp 1 (interleaved)"; one micro-batch is
    singular."""
    def line(num_micro: int, *flags: str) -> str:
        lines: list[str] = []
        config = config_from_args(build_parser("train").parse_args([*BASE, "--pipeline-model-parallel-size", "2",
                                                                     *flags]))
        build_pipeline(config, SimpleNamespace(pp=2), num_micro, lines.append)
        return lines[0].splitlines()[0]

    assert line(4, "--pipeline-schedule", "zb-h1").startswith("pipeline: zb-h1 schedule, pp 2, 4 micro-batches per "
                                                              "step (bubble ")
    assert line(1).startswith("pipeline: 1f1b schedule, pp 2, 1 micro-batch per step (bubble ")
    assert line(4, "--num-layers-per-virtual-pipeline-stage", "1").startswith(
        "pipeline: interleaved schedule, pp 2 x vpp 2 (interleaved placement), 4 micro-batches per step")
    assert line(4, "--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "1").startswith(
        "pipeline: zbv schedule, pp 2 x vpp 2 (v placement), ")
    assert (micro_batches(1), micro_batches(2)) == ("1 micro-batch", "2 micro-batches")


BAD = [  # (extra flags, what the message must say)
    (["--num-layers", "3"], "num_layers=3 is not divisible by pp*vpp=2*1=2"),
    (["--num-layers-per-virtual-pipeline-stage", "3"],
     "num_layers=4 is not divisible by pp*num_layers_per_virtual_pipeline_stage=2*3=6"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6", "--micro-batch-size", "2"],
     "the interleaved schedule needs num_microbatches=3 to be a multiple of pp=2"),
    (["--pipeline-schedule", "interleaved", "--global-batch-size", "3"],
     "the interleaved schedule needs num_microbatches=3 to be a multiple of pp=2"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "gpipe"],
     "--pipeline-schedule=gpipe runs one chunk per rank"),
    (["--decoder-first-pipeline-num-layers", "5"], "decoder first+last pipeline layers=5 exceed num_layers=4"),
    (["--decoder-first-pipeline-num-layers", "1", "--num-layers-per-virtual-pipeline-stage", "1"],
     "cannot be combined with --decoder-first/last-pipeline-num-layers"),
]


@pytest.mark.parametrize("extra,message", BAD)
def test_bad_pipeline_flags_fail_before_any_rank_starts(capsys, monkeypatch, tmp_path, extra, message):
    def no_ranks(*_a, **_k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("moefold.training.cli.train.run_ranks", no_ranks)
    args = [*BASE, "--nproc", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "1",
            "--run-dir", str(tmp_path), "--no-save", *extra]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "--pipeline-model-parallel-size=2" in err, err


@pytest.mark.parametrize("flag", ["--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
                                  "--decoder-last-pipeline-num-layers"])
def test_pipeline_split_flags_need_pp(capsys, monkeypatch, tmp_path, flag):
    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: pytest.fail("a rank was started"))
    assert cli_main([*BASE, "--nproc", "2", "--run-dir", str(tmp_path), "--no-save", flag, "1"]) == 2
    assert f"{flag} needs --pipeline-model-parallel-size > 1" in capsys.readouterr().err
