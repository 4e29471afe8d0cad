"""benchmarks/moe_layer.py runs end to end at tiny sizes (eager rows, one allocator; compiling is tested in
tests/training/test_compile.py)."""

from benchmarks import moe_layer


def test_moe_layer_benchmark_prints_the_machine_and_every_row(capsys):
    argv = ["--tokens", "64", "--hidden", "32", "--configs", "4,2,32", "--iters", "1", "--dtypes", "fp32",
            "--allocators", "default", "--no-compile"]
    assert moe_layer.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and "cpu capability" in out and "allocator" in out
    rows = [line for line in out.splitlines() if line.startswith("fp32")]
    assert len(rows) == 1 and "eager" in rows[0], out
