"""``moefold train``'s overlap and schedule flags: they reach the config, and what cannot run fails with one line
naming the flag before any rank starts (Megatron's refusals for --overlap-moe-expert-parallel-comm)."""

from __future__ import annotations

import pytest

from moefold.training.cli import build_parser
from moefold.training.cli import main as cli_main
from moefold.training.cli.train import config_from_args

BASE = ["train", "--recipe", "deepseek_v3_tiny", "--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "1", "--device", "cpu", "--no-balance-report"]
OVERLAP = ["--overlap-moe-expert-parallel-comm"]

BAD = [  # (nproc, extra flags, what the message must say)
    (2, OVERLAP, "needs --expert-model-parallel-size > 1, got 1"),
    (2, [*OVERLAP, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
     "runs with the alltoall and flex dispatchers, not --moe-token-dispatcher-type allgather"),
    (2, [*OVERLAP, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
         "--moe-flex-dispatcher-backend", "deepep"], "not --moe-flex-dispatcher-backend deepep"),
    (2, ["--delay-wgrad-compute"], "--delay-wgrad-compute defers the experts' and attention's weight gradients"),
    (4, [*OVERLAP, "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     "needs virtual pipeline stages"),
    (4, [*OVERLAP, "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--pipeline-schedule", "zb-h1"], "'zb-h1' has no forward/backward pairs to overlap"),
    (2, [*OVERLAP, "--expert-model-parallel-size", "2", "--recompute-granularity", "selective",
         "--recompute-modules", "moe"], "cannot checkpoint the whole MoE layer"),
    (2, [*OVERLAP, "--expert-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-num-layers",
         "2"], "would checkpoint several layers as one unit across their exchanges"),
    (2, [*OVERLAP, "--expert-model-parallel-size", "2", "--compile"], "--compile cannot be combined"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"],
     "runs 2 chunks per rank in V placement: set --num-layers-per-virtual-pipeline-stage=1"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--moe-grouped-gemm-backend", "te"],
     "not Transformer Engine's"),
]


@pytest.mark.parametrize("nproc,extra,message", BAD)
def test_bad_overlap_flags_fail_before_any_rank_starts(capsys, monkeypatch, tmp_path, nproc, extra, message):
    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: pytest.fail("a rank was started"))
    assert cli_main([*BASE, "--nproc", str(nproc), "--run-dir", str(tmp_path), "--no-save", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_overlap_and_schedule_flags_reach_the_config():
    args = build_parser("train").parse_args([*BASE, *OVERLAP, "--delay-wgrad-compute", "--pipeline-model-parallel-size",
                                             "2", "--num-layers-per-virtual-pipeline-stage", "1",
                                             "--pipeline-schedule", "dualpipev"])
    c = config_from_args(args)
    assert c.train.overlap_moe_expert_parallel_comm and c.train.delay_wgrad_compute
    assert c.schedule_name(2) == "dualpipev" and c.pipeline_layout(2).placement.value == "v"
    assert c.split_backward(2)
