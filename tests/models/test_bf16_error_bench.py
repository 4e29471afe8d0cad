"""benchmarks/bf16_error.py runs end to end at a tiny size: the machine line, every system's row, the islands and
the bisect rows; bad sizes exit 2."""

from benchmarks import bf16_error


def test_bf16_error_benchmark_prints_every_row(capsys):
    argv = ["--recipes", "mixtral_tiny", "--seeds", "1", "--batch", "1", "--seq", "16", "--no-megatron", "--islands",
            "--bisect"]
    assert bf16_error.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("# machine: ")
    text = "\n".join(line for line in out.splitlines() if line.startswith("mixtral_tiny"))
    for system in ["moefold ", "HF transformers", "moefold / HF", *(f"moefold without {n}" for n in
                                                                   bf16_error.ISLAND_REMOVALS),
                   *(f"moefold, {n} in fp32" for n in bf16_error.BISECT)]:
        assert system in text, system


def test_bf16_error_benchmark_rejects_bad_sizes(capsys):
    assert bf16_error.main(["--seeds", "0"]) == 2
    assert "--seeds=0 must be >= 1" in capsys.readouterr().err
    assert bf16_error.main(["--first-seed", "-1"]) == 2
    assert "--first-seed=-1 must be >= 0" in capsys.readouterr().err
    assert bf16_error.main(["--threads", "0"]) == 2
    assert "--threads=0 must be >= 1" in capsys.readouterr().err
