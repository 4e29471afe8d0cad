"""``moefold bench-dispatch`` runs end to end (tiny sizes) in-process and on 2 spawned gloo ranks."""

import argparse

from moefold.dispatch import bench
from moefold.training.cli import build_parser


def _args(**overrides) -> argparse.Namespace:
    argv = ["bench-dispatch", "--num-tokens", "64", "--hidden", "16", "--num-experts", "4", "--topk", "2",
            "--iters", "2", "--warmup", "1"]
    args = build_parser("bench-dispatch").parse_args(argv)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def test_bench_single_process(capsys):
    assert bench.main(_args(ep=1, dispatcher="local")) == 0
    out = capsys.readouterr().out
    assert "dispatcher=local" in out and "unpermute" in out and "nothing to exchange" in out


def test_bench_spawns_ranks(capfd):
    assert bench.main(_args(ep=2, skew="zipf", dtype="bf16")) == 0
    out = capfd.readouterr().out
    assert "ratio dispatcher / raw" in out and "GB/s" in out and "local permute+unpermute alone" in out


def test_bench_rejects_bad_flags():
    import pytest

    with pytest.raises(ValueError, match="--topk=5 exceeds --num-experts=4"):
        bench.main(_args(topk=5))
