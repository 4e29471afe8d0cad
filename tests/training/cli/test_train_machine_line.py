"""``moefold train`` on the CPU prints the machine line with the host allocator it set up before the ranks started,
and with ``--bf16`` on a CPU without bf16 matmul units says once that fp32 is faster (issue 32, items 1 and 4)."""

from __future__ import annotations

from moefold.training.cli import main as cli_main
from tests.training.trainer_common import tiny_corpus


def test_cpu_run_prints_machine_line_allocator_and_bf16_notice(tmp_path, monkeypatch, capsys, one_thread):
    calls = []
    # stand-ins: the real setting changes this process for good (tests/training/launch/test_allocator.py runs it)
    monkeypatch.setattr("moefold.training.cli.train.tune_cpu_allocator", lambda: calls.append(1) or "stub setting")
    monkeypatch.setattr("moefold.training.cli.train.bf16_slower_notice", lambda: "fp32 is faster here (0.25x)")
    base = ["train", "--recipe", "qwen3_moe_tiny", "--data-path", tiny_corpus(tmp_path / "tiny", 16),
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
            "--device", "cpu", "--no-save", "--no-balance-report", "--no-progress"]
    assert cli_main([*base, "--run-dir", str(tmp_path / "bf16"), "--bf16"]) == 0
    out = capsys.readouterr()
    machine = [line for line in out.out.splitlines() if line.startswith("# machine: ")]
    assert len(machine) == 1 and machine[0].endswith("host allocator: stub setting") and calls == [1]
    assert out.err.count("moefold train: fp32 is faster here (0.25x)") == 1
    assert cli_main([*base, "--run-dir", str(tmp_path / "fp32")]) == 0
    assert "fp32 is faster" not in capsys.readouterr().err
