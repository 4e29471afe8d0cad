"""benchmarks/row_layouts.py runs end to end at tiny sizes: the machine line, one row per (config, layout) with the
first step, four quarters and the last half, the plot, and a clear error for too few steps."""

import pytest

from benchmarks import row_layouts


def test_row_layouts_benchmark_prints_every_layout_and_plots(tmp_path, capsys):
    png = tmp_path / "layouts.png"
    row_layouts.main(["--tokens", "64", "--hidden", "32", "--configs", "4,2,32;8,2,16", "--steps", "4",
                      "--dtype", "fp32", "--plot", str(png)])
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and "a new input (new routing) every step" in out
    rows = [line.split() for line in out.splitlines() if line[:1] == " " and line.split()[0].isdigit()]
    assert [(r[0], r[3]) for r in rows] == [(e, lay) for e in ("4", "8") for lay in ("packed", "aligned", "uniform")]
    assert all(len(r) == 10 and all(float(v) > 0 for v in r[4:]) for r in rows), out
    assert png.stat().st_size > 0


def test_row_layouts_benchmark_refuses_too_few_steps(capsys):
    with pytest.raises(SystemExit):
        row_layouts.main(["--steps", "3"])
    assert "--steps=3; valid: an integer >= 4" in capsys.readouterr().err
