"""MetricsLogger: JSONL records, one printed line per logging step, TensorBoard, peak FLOP/s, MFU."""

import json
import math

import pytest
import torch

from moefold.training.observe.hardware import (
    cached_peak,
    device_peak,
    measure_matmul_peak,
    memory_stats,
    mfu,
    peak_flops,
    table_peak_flops,
)
from moefold.training.observe.metric_lines import format_line
from moefold.training.observe.metrics import MetricsLogger, load_balance, read_metrics


def test_logger_writes_jsonl_and_one_line(tmp_path):
    lines = []
    with MetricsLogger(tmp_path, total_steps=20, flops_per_token=6e9, peak_flops_per_s=1e14, progress=False,
                       tensorboard=False, print_fn=lines.append, config={"recipe": "tiny"}) as logger:
        rec = logger.log(10, loss_lm=5.0, loss_aux=0.25, loss_z=0.125, grad_norm=1.5, lr=3e-4, tokens=4096,
                         interval_s=2.0, tokens_per_expert=[[10, 10, 10, 10], [40, 0, 0, 0]],
                         dropped_fraction=[0.0, 0.5], moe_layers=[1, 3])
        logger.advance(10)
        logger.log(20, loss_lm=float("nan"), tokens=0, interval_s=1.0, skipped=True,
                   extra={"lr_scale": torch.tensor(0.5), "bad": [float("inf")]})
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    line = lines[0]
    for piece in ("step 10/20", "loss 5.3750 (lm 5.0000 aux 0.2500 z 0.1250)", "gnorm 1.500", "lr 3.000e-04",
                  "2.05k tok/s", "12.3 TFLOP/s", "MFU 12.3%", "rss ", "load max/mean 4.00 (layer 3)",
                  "dropped 50.0%"):
        assert piece in line, (piece, line)
    assert "SKIPPED" in lines[1] and "loss n/a" in lines[1]
    assert rec["tokens_per_s"] == 2048.0 and rec["mfu"] == pytest.approx(2048 * 6e9 / 1e14)

    raw = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in raw] == ["run", "step", "step"]
    assert raw[0]["config"] == {"recipe": "tiny"} and raw[0]["total_steps"] == 20
    moe = raw[1]["moe"]
    assert moe == {"layers": [1, 3], "tokens_per_expert": [[10, 10, 10, 10], [40, 0, 0, 0]],
                   "dropped_fraction": [0.0, 0.5], "max_over_mean": [1.0, 4.0], "worst_layer": 3}
    assert raw[2]["loss_lm"] is None and raw[2]["skipped"] is True and raw[2]["moe"] is None
    assert raw[2]["extra"] == {"lr_scale": 0.5, "bad": [None]}

    # A run resumed at step 10 (the step 20 record came after that checkpoint, and a crash cut a line short):
    # the records after step 10 go, so every step has one record.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "step": 2')
    with MetricsLogger(tmp_path, start_step=10, progress=False, tensorboard=False, print_fn=lines.append) as logger:
        logger.log(20, loss_lm=4.0, tokens=10)
    raw = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r.get("step")) for r in raw] == [("run", None), ("step", 10), ("run", None), ("step", 20)]
    assert raw[3]["loss_lm"] == 4.0 and "dropped 2 records after step 10" in lines[2], lines
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [10, 20]
    with pytest.raises(ValueError, match="tokens_per_expert has 2 layers, dropped_fraction 1"):
        MetricsLogger._moe([[1], [2]], [0.0], None)


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, progress=False, tensorboard=True, print_fn=lambda s: None) as logger:
        logger.log(1, loss_lm=2.0, tokens_per_expert=[[1, 3]], dropped_fraction=[0.0])
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_format_line_gpu_memory():
    rec = {"step": 3, "loss": 1.0, "loss_lm": 1.0, "grad_norm": None, "lr": None, "tokens_per_s": 12.0,
           "memory": {"max_allocated_gib": 1.5, "device_used_gib": 3.25, "device_total_gib": 80.0, "rss_gib": 2.0}}
    assert format_line(rec) == ("step 3 | loss 1.0000 (lm 1.0000) | gnorm n/a | lr n/a | 12.0 tok/s | "
                                "mem 1.50 GiB max alloc, dev 3.2/80 GiB")


def test_peak_flops_and_mfu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))   # peak_flops caches its measurement there
    assert table_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert table_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert table_peak_flops("NVIDIA H200") == 989e12
    assert table_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert table_peak_flops("Some CPU") is None
    measured = measure_matmul_peak("cpu", torch.float32, n=128, seconds=0.05)
    assert 1e7 < measured < 1e14 and measure_matmul_peak("cpu", torch.float32, n=128, seconds=0.05) == measured
    assert peak_flops("cpu", torch.float32) > 0
    assert mfu(1000.0, 6e9, 1.2e13) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_flops_per_s=0"):
        mfu(1.0, 1.0, 0)
    assert load_balance([[2, 2], [0, 0], [3, 1]]) == [1.0, None, 1.5]
    mem = memory_stats("cpu")
    assert set(mem) == {"rss_gib", "peak_rss_gib"} and 0 < mem["rss_gib"] < 1024 and math.isfinite(mem["rss_gib"])
    assert mem["peak_rss_gib"] > 0


def test_measured_peak_is_cached_per_machine_so_mfu_is_comparable(tmp_path, monkeypatch):
    """A CPU's peak is measured once and cached: a second run divides by the same figure however loaded the
    machine is then (a measurement under load gave 32.4 and 6.19 GFLOP/s in two runs), and names its source."""
    path = tmp_path / "peak_flops.json"
    calls = []
    first = cached_peak("cpu X, fp32", lambda: calls.append(1) or 3.0e10, path)
    again = cached_peak("cpu X, fp32", lambda: calls.append(1) or 6.0e9, path)   # "loaded": would measure less
    assert calls == [1] and first.flops_per_s == again.flops_per_s == 3.0e10
    assert again.source.startswith("measured: cpu X, fp32, ") and str(path) in again.source
    other = cached_peak("cpu Y, fp32", lambda: 5.0e9, path)   # another machine kind: its own entry
    assert other.flops_per_s == 5.0e9 and set(json.loads(path.read_text())) == {"cpu X, fp32", "cpu Y, fp32"}
    path.write_text("{not json")   # a damaged cache is measured again and rewritten
    assert cached_peak("cpu X, fp32", lambda: 2.0e10, path).flops_per_s == 2.0e10
    # the real device key: torch's CPU capability and thread count are part of it; the file lands in XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    peak = device_peak("cpu", torch.float32)
    assert f"capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads" in peak.source
    assert (tmp_path / "xdg" / "moefold" / "peak_flops.json").exists()
    assert device_peak("cpu").flops_per_s == peak.flops_per_s   # CPU bf16 runs divide by the fp32 figure too
    with MetricsLogger(tmp_path / "run", peak_flops_per_s=peak.flops_per_s, peak_flops_source=peak.source,
                       progress=False, tensorboard=False, print_fn=lambda _: None):
        pass
    header = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert header["peak_flops_source"] == peak.source


def test_received_counts_are_logged_with_their_balance():
    """The dispatcher's received copies per expert (DeepEP V2's): in the record and as a per-layer scalar."""
    moe = MetricsLogger._moe([[4, 4], [6, 2]], [0.0, 0.25], [1, 3], None, [[4, 4], [6, 0]])
    assert moe["received_per_expert"] == [[4, 4], [6, 0]] and moe["received_max_over_mean"] == [1.0, 2.0]
    scalars = MetricsLogger._scalars({"memory": {}, "moe": moe})
    assert scalars["moe_received_max_over_mean/layer03"] == 2.0 and scalars["moe_max_over_mean/layer03"] == 1.5
    with pytest.raises(ValueError, match="received_per_expert has 1 layers, expected 2"):
        MetricsLogger._moe([[1], [2]], [0.0, 0.0], None, None, [[1]])
