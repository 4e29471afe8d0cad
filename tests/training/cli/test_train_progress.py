"""``moefold train`` draws its progress bar only on a terminal, and never with ``--no-progress`` (issue 27, item 5:
a log file used to get 242 redraws for 250 steps)."""

from __future__ import annotations

import io

from moefold.training.cli import main as cli_main
from tests.training.trainer_common import tiny_corpus


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, capsys, one_thread):
    base = ["train", "--recipe", "qwen3_moe_tiny", "--data-path", tiny_corpus(tmp_path / "tiny", 16),
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3",
            "--device", "cpu", "--no-save", "--no-balance-report"]
    assert cli_main([*base, "--run-dir", str(tmp_path / "log")]) == 0   # pytest's stderr: not a terminal
    captured = capsys.readouterr()
    assert "done: 3 steps" in captured.out and "step/s" not in captured.err + captured.out
    for flags, drawn in (([], True), (["--no-progress"], False)):
        terminal = _Terminal()
        monkeypatch.setattr("sys.stderr", terminal)
        assert cli_main([*base, "--run-dir", str(tmp_path / f"tty{len(flags)}"), *flags]) == 0
        assert ("train: 100%" in terminal.getvalue() and "3/3" in terminal.getvalue()) == drawn, terminal.getvalue()
