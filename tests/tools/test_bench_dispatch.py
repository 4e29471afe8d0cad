"""``moefold bench-dispatch`` runs end to end (tiny sizes) in-process and on 2 spawned gloo ranks."""

import argparse

from moefold.tools import bench_dispatch
from moefold.training.cli import build_parser


def _args(**overrides) -> argparse.Namespace:
    argv = ["bench-dispatch", "--num-tokens", "64", "--hidden", "16", "--num-experts", "4", "--topk", "2",
            "--iters", "2", "--warmup", "1"]
    args = build_parser("bench-dispatch").parse_args(argv)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def test_bench_single_process(capsys):
    assert bench_dispatch.main(_args(ep=1, dispatcher="local")) == 0
    out = capsys.readouterr().out
    assert "dispatcher=local" in out and "unpermute" in out and "nothing to exchange" in out


def test_bench_spawns_ranks(capfd):
    # one command, one world: both dispatchers and both skews, against their own raw collectives
    assert bench_dispatch.main(_args(ep=2, skew="uniform,zipf", dtype="bf16", dispatcher="alltoall,allgather")) == 0
    out = capfd.readouterr().out
    assert out.startswith("# machine: ") and "cpu capability" in out
    assert "raw all_to_all_single x2 (same token bytes)" in out and "raw all_gather + reduce_scatter" in out
    assert "ratio dispatcher / raw" in out and "local permute+unpermute alone" in out and "ideal exchange" in out
    summary = out[out.index("summary"):].splitlines()
    assert len([line for line in summary if line.startswith(("alltoall", "allgather"))]) == 4


def test_bench_rejects_bad_flags():
    import pytest

    with pytest.raises(ValueError, match="--topk=5 exceeds --num-experts=4"):
        bench_dispatch.main(_args(topk=5))
    with pytest.raises(ValueError, match=r"--dispatcher='alltoall,nccl': valid values are local, allgather"):
        bench_dispatch.main(_args(dispatcher="alltoall,nccl"))
