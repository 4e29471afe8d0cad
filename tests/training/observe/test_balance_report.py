"""`moefold balance-report` writes readable PNGs and a summary from a metrics JSONL."""

import numpy as np
import pytest

from moefold.training.cli import main as cli_main
from moefold.training.observe import balance_report
from moefold.training.observe.balance_report import LoadHistory, load_history, plot_heatmaps, plot_over_steps, summarize
from moefold.training.observe.metrics import MetricsLogger


def _synthetic_run(run_dir, steps=30, layers=(1, 2, 3), experts=8):
    rng = np.random.default_rng(0)
    with MetricsLogger(run_dir, total_steps=steps, progress=False, tensorboard=False,
                       print_fn=lambda s: None) as logger:
        for step in range(1, steps + 1):
            tpe = []
            for li in range(len(layers)):
                skew = np.linspace(1, 1 + 2 * li * (1 - step / steps), experts)  # layer 3 starts imbalanced
                counts = rng.poisson(100 * skew)
                if li == 2 and experts > 5:
                    counts[5] = 0  # a dead expert
                tpe.append(counts.tolist())
            logger.log(step, loss_lm=3.0, tokens=1024, interval_s=1.0, tokens_per_expert=tpe,
                       dropped_fraction=[0.0, 0.01, *[0.05 * (1 - step / steps)] * (len(layers) - 2)],
                       moe_layers=list(layers))


def test_balance_report_cli(tmp_path, capsys):
    _synthetic_run(tmp_path)
    assert cli_main(["balance-report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "worst layers: layer 3" in out and "layer 3: [5]" in out
    report = tmp_path / "balance_report"
    for name in ("expert_load_heatmap.png", "load_over_steps.png"):
        data = (report / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    summary = (report / "summary.txt").read_text()
    assert "steps 1..30 (30 records), 3 MoE layers x 8 experts" in summary
    assert "never-used experts (no tokens in any record): layer 3: [5]" in summary


def test_balance_report_pages_and_many_layers(tmp_path, monkeypatch):
    _synthetic_run(tmp_path, steps=4, layers=tuple(range(3, 15)), experts=4)
    h = load_history(tmp_path / "metrics.jsonl")
    assert len(h.layers) == 12 and h.counts[0].shape == (4, 4)
    assert plot_over_steps(h, tmp_path).stat().st_size > 0  # > 10 layers: thin lines + the worst layer
    monkeypatch.setattr(balance_report, "LAYERS_PER_PAGE", 2)
    small = LoadHistory(h.steps, h.layers[:3], h.counts[:3], h.dropped[:, :3])
    pages = plot_heatmaps(small, tmp_path)
    assert [p.name for p in pages] == ["expert_load_heatmap.png", "expert_load_heatmap_p2.png"]
    assert "worst layers:" in summarize(h)


def test_balance_report_errors(tmp_path, capsys):
    assert cli_main(["balance-report", str(tmp_path)]) == 2
    assert "metrics.jsonl: no metrics file" in capsys.readouterr().out
    with MetricsLogger(tmp_path, progress=False, tensorboard=False, print_fn=lambda s: None) as logger:
        logger.log(1, loss_lm=1.0)
    with pytest.raises(ValueError, match="no step record has MoE load data"):
        load_history(tmp_path / "metrics.jsonl")
