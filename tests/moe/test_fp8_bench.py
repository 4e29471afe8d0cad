"""benchmarks/fp8.py runs end to end at tiny sizes for the block-scaled recipes (the per-tensor ones go through
torch's CPU ``_scaled_mm``, far too slow for a test): the machine line, then per recipe a linear, an outlier and a
MoE-layer line with its errors against fp32 next to bf16's and, on CPU, the emulation cost."""

from benchmarks import fp8


def test_fp8_benchmark_prints_every_block_recipe(capsys):
    argv = ["--tokens", "64", "--hidden", "128", "--configs", "4,2,128", "--iters", "1", "--threads", "1",
            "--recipes", "e4m3:blockwise,e4m3:mxfp8,e2m1:nvfp4"]
    assert fp8.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and "EMULATED" in out
    for recipe in ("blockwise", "mxfp8", "nvfp4"):
        rows = [line for line in out.splitlines() if f" {recipe} " in line and "vs fp32" in line]
        assert len(rows) == 3 and all("emulation cost" in r and "(bf16: y" in r for r in rows), (recipe, out)
