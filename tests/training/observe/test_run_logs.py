"""What a run prints and leaves behind (issue 27, item 5): a progress bar only on a terminal, FLOP/s in a unit
that fits, drops shown only when there are any, MTP layers labelled, one TensorBoard directory per run."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest

from moefold.training.observe.balance_report import load_history, plot_over_steps, summarize
from moefold.training.observe.metric_lines import format_flops, format_line
from moefold.training.observe.metrics import MetricsLogger


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch):
    not_a_terminal = io.StringIO()
    monkeypatch.setattr("sys.stderr", not_a_terminal)
    with MetricsLogger(tmp_path / "a", total_steps=3, tensorboard=False, print_fn=lambda _s: None) as logger:
        for _ in range(3):
            logger.advance()
    assert not_a_terminal.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with MetricsLogger(tmp_path / "b", total_steps=3, tensorboard=False, print_fn=lambda _s: None) as logger:
        for _ in range(3):
            logger.advance()
    assert "3/3" in terminal.getvalue()   # the bar, drawn on the terminal
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)   # --no-progress: never
    with MetricsLogger(tmp_path / "c", total_steps=3, tensorboard=False, progress=False,
                       print_fn=lambda _s: None) as logger:
        logger.advance()
    assert terminal.getvalue() == ""


def test_flops_in_a_unit_that_fits():
    assert format_flops(3.2e9) == "3.20 GFLOP/s"      # a tiny recipe on a CPU (was "0.00 TFLOP/s")
    assert format_flops(45.6e9) == "45.6 GFLOP/s"
    assert format_flops(412e12) == "412 TFLOP/s"
    assert format_flops(1.5e15) == "1.50 PFLOP/s"
    rec = {"step": 1, "loss": 1.0, "loss_lm": 1.0, "tokens_per_s": 100.0, "tflops_per_s": 0.0042, "mfu": 0.01,
           "memory": {}}
    assert "4.20 GFLOP/s | MFU 1.0%" in format_line(rec)


def test_drops_shown_only_when_there_are_any_and_mtp_layers_labelled():
    moe = {"layers": [1, 2, 3], "max_over_mean": [1.1, 1.2, 1.9], "worst_layer": 3, "dropped_fraction": [0, 0, 0]}
    rec = {"step": 1, "loss": 1.0, "loss_lm": 1.0, "tokens_per_s": 1.0, "memory": {}, "moe": moe}
    line = format_line(rec, num_layers=3)
    assert "load max/mean 1.90 (MTP 1)" in line and "dropped" not in line
    assert "(layer 3), dropped 5.0%" in format_line({**rec, "moe": {**moe, "dropped_fraction": [0, 0, 0.05]}})


def _run(run_dir, dropped: float, num_layers: int = 2, mtp: int = 1, steps: int = 6):
    rng = np.random.default_rng(0)
    layers = list(range(1, num_layers + mtp))   # layer 0 dense, then MoE layers, then the MTP block(s)
    with MetricsLogger(run_dir, total_steps=steps, progress=False, tensorboard=False, print_fn=lambda _s: None,
                       config={"model": {"num_layers": num_layers}}) as logger:
        for step in range(1, steps + 1):
            logger.log(step, loss_lm=3.0, tokens=64, interval_s=1.0, moe_layers=layers,
                       tokens_per_expert=[rng.poisson(50, 4).tolist() for _ in layers],
                       dropped_fraction=[dropped] * len(layers))


def _png_height(path) -> int:
    return struct.unpack(">I", path.read_bytes()[20:24])[0]


def test_balance_report_drops_panel_only_with_drops_and_mtp_labels(tmp_path):
    _run(tmp_path / "dropless", 0.0)
    h = load_history(tmp_path / "dropless" / "metrics.jsonl")
    text = summarize(h)
    assert "dropped" not in text and "  MTP 1:" in text and "  layer 1:" in text, text
    single = _png_height(plot_over_steps(h, tmp_path / "dropless"))
    _run(tmp_path / "capacity", 0.02)
    h = load_history(tmp_path / "capacity" / "metrics.jsonl")
    assert "dropped fraction: mean 2.00%, max 2.00% (layer 1, step 1)" in summarize(h)
    assert _png_height(plot_over_steps(h, tmp_path / "capacity")) > 1.5 * single   # the second panel


def test_one_tensorboard_directory_per_run(tmp_path):
    pytest.importorskip("tensorboard")
    events = lambda: sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    lines: list[str] = []
    for _ in range(2):   # two fresh runs in a row in one directory
        with MetricsLogger(tmp_path, progress=False, tensorboard=True, print_fn=lines.append) as logger:
            logger.log(1, loss_lm=2.0)
    assert len(events()) == 1, events()
    assert any("removed 1 event file(s) of the earlier run" in line for line in lines)
    first = events()[0]
    with MetricsLogger(tmp_path, start_step=1, progress=False, tensorboard=True, print_fn=lines.append) as logger:
        logger.log(2, loss_lm=1.0)   # a resumed run: its own file beside the one it continues, same directory
    assert first in events() and len(events()) == 2
