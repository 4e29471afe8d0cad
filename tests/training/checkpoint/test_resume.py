"""Resuming ``moefold train``: a longer run continues the same data (20 -> 40 steps equals 40 uninterrupted, bit
for bit), metrics.jsonl has one record per step after a crash and resume, and a resume that would change the data
order (another --seq-length, --seed or --data-path) is refused unless --reset-data-position says otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from moefold.parallel.dims import ParallelDims
from moefold.training.cli import build_parser
from moefold.training.cli import main as cli_main
from moefold.training.cli.train import config_from_args
from moefold.training.data.indexed import IndexedDatasetWriter
from moefold.training.observe.metrics import METRICS_FILE
from moefold.training.run import build_dataset
from tests.training.trainer_common import tiny_data

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ["train", "--recipe", "qwen3_moe_tiny", "--num-layers", "2", "--vocab-size", "256", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2", "--lr-decay-iters", "40",
        "--log-interval", "1", "--device", "cpu", "--no-balance-report"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("data") / "tiny"
    with IndexedDatasetWriter(prefix, 256) as writer:   # 24 samples per epoch: 40 steps x 4 span 7 epochs
        for row in tiny_data(24):
            writer.add_document(row)
    return str(prefix)


def _steps(run_dir: Path) -> list[tuple[int, float]]:
    import json

    recs = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["kind"] == "step"]


def test_runs_of_any_length_see_the_same_samples(corpus):
    def samples(iters: int) -> np.ndarray:
        config = config_from_args(build_parser("train").parse_args([*BASE, "--data-path", corpus, "--train-iters",
                                                                    str(iters)]))
        ds = build_dataset(config, ParallelDims.single())
        return np.stack([ds[i] for i in range(20 * 4)])

    np.testing.assert_array_equal(samples(20), samples(40))


def test_resume_20_to_40_equals_40_uninterrupted_with_one_metrics_record_per_step(corpus, tmp_path):
    base = [*BASE, "--data-path", corpus]
    assert cli_main([*base, "--train-iters", "40", "--run-dir", str(tmp_path / "whole"), "--no-save"]) == 0
    whole = _steps(tmp_path / "whole")
    assert [s for s, _ in whole] == list(range(1, 41))
    # 25 steps with a checkpoint at 20; the run "crashes" before its final save (iter_25 is removed)
    run, save = tmp_path / "parts", tmp_path / "ckpt"
    assert cli_main([*base, "--train-iters", "25", "--save-interval", "20", "--run-dir", str(run), "--save",
                     str(save)]) == 0
    shutil.rmtree(save / "iter_0000025")
    assert cli_main([*base, "--train-iters", "40", "--run-dir", str(run), "--save", str(save), "--load",
                     str(save)]) == 0
    assert _steps(run) == whole   # every step once, and the same losses bit for bit


def test_resume_with_another_seq_length_is_refused_unless_the_data_position_restarts(corpus, tmp_path, capsys):
    base = [*BASE, "--data-path", corpus, "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt")]
    assert cli_main([*base, "--train-iters", "2"]) == 0
    capsys.readouterr()
    for flag, value in (("--seq-length", "16"), ("--seed", "5")):
        args = [*base, "--train-iters", "3", "--load", str(tmp_path / "ckpt"), flag, value]
        assert cli_main(args) == 2   # known before any rank starts: the checkpoint's meta.json says it
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "moefold train: error: cannot resume from" in err, err
        old = {"--seq-length": "32", "--seed": "1234"}[flag]
        assert f"with {flag} {value} (checkpoint: {old}): the data order depends on them" in err, err
        assert "pass --reset-data-position" in err, err
    # Megatron's order also depends on the run's sizes, which a moefold-order checkpoint does not record as such
    assert cli_main([*base, "--train-iters", "3", "--load", str(tmp_path / "ckpt"), "--data-order", "megatron",
                     "--split", "90,10,0"]) == 2
    err = capsys.readouterr().err
    named = ("with --data-order megatron (checkpoint: moefold), --train-iters 3 (checkpoint: None), "
             "--global-batch-size 4 (checkpoint: None), --split 90,10,0 (checkpoint: None): the data order")
    assert err.count("\n") == 1 and named in err, err
    assert cli_main([*base, "--train-iters", "3", "--load", str(tmp_path / "ckpt"), "--seq-length", "16",
                     "--reset-data-position"]) == 0
    out = capsys.readouterr().out
    assert "--seq-length 16 (checkpoint: 32); the data position restarts at sample 0 of the new order" in out
    assert "resumed from" in out and "consumed_samples 0" in out


def test_resume_refuses_another_model_naming_the_field_and_states_allowed_changes(corpus, tmp_path, capsys):
    """The checkpoint stores the whole model config: --moe-router-topk 4 on a top-2 checkpoint (or another recipe)
    is refused before any rank starts, naming the field; another --global-batch-size, learning-rate schedule or
    aux-loss weight is allowed and said in one line each (as in Megatron)."""
    base = [*BASE, "--data-path", corpus, "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt")]
    assert cli_main([*base, "--train-iters", "2"]) == 0
    capsys.readouterr()
    resume = [*base, "--train-iters", "3", "--load", str(tmp_path / "ckpt")]
    for flags, named in ((["--moe-router-topk", "4"], "moe_topk 4 (checkpoint: 2)"),
                         (["--num-experts", "16"], "num_experts 16 (checkpoint: 8)"),
                         (["--recipe", "mixtral_tiny"], "--recipe mixtral_tiny (checkpoint: qwen3_moe_tiny)")):
        assert cli_main([*resume, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"moefold train: error: cannot resume from {tmp_path}/ckpt/"
                                                       "iter_0000002: the model differs from the checkpoint's: "), err
        assert named in err and "model:" not in err, err
    assert cli_main([*resume, "--global-batch-size", "8", "--lr", "1e-3", "--moe-aux-loss-coeff", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "note: resuming with moe_aux_loss_coeff 0.01 (checkpoint: 0.001)" in out, out
    assert "note: --global-batch-size 8 (checkpoint: 4): the run continues at sample 8 of the same order" in out, out
    assert "note: the learning-rate schedule differs from the checkpoint's run: --lr 0.001 (checkpoint: 0.003)" in out
    assert "resumed from" in out


def test_the_trainer_refuses_another_model_too(tmp_path):
    """The same check where the ranks load (a resume that fell back to an older checkpoint is checked again)."""
    import dataclasses

    from moefold.training.trainer import Trainer
    from tests.training.trainer_common import run, tiny_config

    save = str(tmp_path / "ckpt")
    run(tiny_config(save=save), stop_at=1)
    config = tiny_config()
    top3 = dataclasses.replace(config, model=config.model.with_(moe_topk=3))
    with pytest.raises(ValueError, match=r"the model differs from the checkpoint's: moe_topk 3 \(checkpoint: 2\)"):
        Trainer(top3, ParallelDims.single(), log=lambda _m: None).load(save)
