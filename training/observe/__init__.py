"""What a run measures and reports: the metrics line and metrics.jsonl, hardware counters and MFU, memory
(static bytes, peaks), FLOPs, host syncs, routing imbalance against the plan, the load-balance report and the FP8
summary.

Holds: metrics (the logger and metrics.jsonl), metric_lines (the printed lines), expert_counts (the per-MoE-layer
counts a step sums), log_window (the steps between two records), hardware, memory, flops, host_sync, imbalance,
balance_report, fp8_report.
May import: moefold.models, moefold.moe, moefold.dense, moefold.parallel; training.optim (precision).
"""

from moefold.training.observe.flops import forward_flops_per_token, train_flops_per_token
from moefold.training.observe.host_sync import HostSyncCounter
from moefold.training.observe.imbalance import LoadRatioWatch, micro_batch_load_ratio
from moefold.training.observe.memory import TensorMemoryTracker, measure_peak, static_bytes
from moefold.training.observe.metrics import METRICS_FILE, MetricsLogger, read_metrics

__all__ = [
    "MetricsLogger", "read_metrics", "METRICS_FILE", "forward_flops_per_token", "train_flops_per_token",
    "HostSyncCounter", "TensorMemoryTracker", "measure_peak", "static_bytes", "LoadRatioWatch",
    "micro_batch_load_ratio",
]
