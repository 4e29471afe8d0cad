"""Per-logging-step metrics: one printed line, a JSONL record, TensorBoard scalars, a progress bar.

Only the logging rank (rank 0) builds a ``MetricsLogger``; every value handed to it must already be
global (reduced over the ranks that own it), so nothing here crosses ranks.

JSONL schema (``RUN_DIR/metrics.jsonl``, one JSON object per line, appended across resumes)
------------------------------------------------------------------------------------------
A run record, written when a logger opens::

    {"kind": "run", "schema": 1, "time": <unix s>, "start_step": int, "total_steps": int | null,
     "flops_per_token": float | null, "peak_flops_per_s": float | null, "config": {...} | null,
     "fp8": str | null}               # which GEMMs run in FP8 (training.fp8_report.fp8_tag), also on every line

A step record per logging step (``null``: not measured, or not finite)::

    {"kind": "step", "schema": 1, "step": int, "time": <unix s>, "interval_s": float,
     "loss": float,                  # lm + aux + z + mtp (those given)
     "loss_lm": float, "loss_aux": float|null, "loss_z": float|null, "loss_mtp": float|null,
     "grad_norm": float|null, "lr": float|null,
     "tokens": int,                  # tokens trained since the previous step record (all ranks)
     "tokens_per_s": float|null, "tflops_per_s": float|null, "mfu": float|null,
     "memory": {"rss_gib": f, "max_allocated_gib": f, "device_used_gib": f, "device_total_gib": f},
     "skipped": bool,                # the optimizer step was skipped (non-finite loss/grad norm)
     "moe": null | {
        "layers": [int, ...],        # model layer number of each MoE layer, in the order below
        "tokens_per_expert": [[int, ...], ...],  # [moe layer][expert]: routed token copies (top-k
                                     #   counted k times) since the previous record, all ranks
        "dropped_fraction": [float, ...],  # [moe layer]: dropped copies / routed copies (capacity)
        "max_over_mean": [float|null, ...],  # [moe layer]: max / mean of tokens_per_expert
        "worst_layer": int|null,     # layer number with the largest max_over_mean
     },
     "extra": {...}}                 # anything else the caller passed

Readers take the last record of each step (a resumed run may log a step twice).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA = 1
METRICS_FILE = "metrics.jsonl"


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _json_safe(x: Any) -> Any:
    """Non-finite floats -> None (strict JSON), tensors/numpy scalars -> Python numbers, recursively."""
    if isinstance(x, Mapping):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 0) == 0:
        x = x.item()
    return _finite(x) if isinstance(x, float) else x


def load_balance(tokens_per_expert: Sequence[Sequence[float]]) -> list[float | None]:
    """max / mean of each layer's expert counts (1.0 = perfectly balanced); None for a layer with no tokens."""
    out: list[float | None] = []
    for counts in tokens_per_expert:
        total = float(sum(counts))
        out.append(max(counts) * len(counts) / total if counts and total > 0 else None)
    return out


def read_metrics(path: str | os.PathLike, kind: str = "step") -> list[dict[str, Any]]:
    """The records of ``kind`` from a metrics JSONL, sorted by step, the last one winning per step.

    Raises ValueError naming the file and line for a line that is not JSON.
    """
    path = Path(path)
    by_step: dict[int, dict[str, Any]] = {}
    others: list[dict[str, Any]] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                if lineno > 1 and not line.endswith("\n"):
                    continue  # a last line cut short by a crash
                raise ValueError(f"{path}:{lineno}: not a JSON record ({exc.msg})") from exc
            if rec.get("kind") != kind:
                continue
            if kind == "step":
                by_step[int(rec["step"])] = rec
            else:
                others.append(rec)
    return [by_step[s] for s in sorted(by_step)] if kind == "step" else others


def format_line(rec: Mapping[str, Any], total_steps: int | None = None) -> str:
    """The one printed line of a step record."""
    def num(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    step = f"{rec['step']}/{total_steps}" if total_steps else str(rec["step"])
    losses = " ".join(f"{k} {num(rec.get('loss_' + k), '.4f')}" for k in ("lm", "aux", "z", "mtp")
                      if rec.get("loss_" + k) is not None or k == "lm")
    parts = [f"step {step}", f"loss {num(rec.get('loss'), '.4f')} ({losses})",
             f"gnorm {num(rec.get('grad_norm'), '.3f')}", f"lr {num(rec.get('lr'), '.3e')}"]
    tps = rec.get("tokens_per_s")
    parts.append("n/a tok/s" if tps is None else f"{tps / 1e3:.2f}k tok/s" if tps >= 1e3 else f"{tps:.1f} tok/s")
    if rec.get("tflops_per_s") is not None:
        parts.append(f"{rec['tflops_per_s']:.2f} TFLOP/s")
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    mem = rec.get("memory") or {}
    if "max_allocated_gib" in mem:
        dev = (f", dev {mem['device_used_gib']:.1f}/{mem['device_total_gib']:.0f} GiB"
               if "device_used_gib" in mem else "")
        parts.append(f"mem {mem['max_allocated_gib']:.2f} GiB max alloc{dev}")
    elif "rss_gib" in mem:
        parts.append(f"rss {mem['rss_gib']:.2f} GiB")
    moe = rec.get("moe")
    if moe and moe.get("worst_layer") is not None:
        i = moe["layers"].index(moe["worst_layer"])
        parts.append(f"load max/mean {moe['max_over_mean'][i]:.2f} (layer {moe['worst_layer']}), "
                     f"dropped {100 * max(moe['dropped_fraction'] or [0.0]):.1f}%")
    if rec.get("skipped"):
        parts.append("SKIPPED (non-finite loss or grad norm)")
    return " | ".join(parts)


class MetricsLogger:
    """Writes ``RUN_DIR/metrics.jsonl`` (see the module docstring), prints one line per ``log()``, adds
    TensorBoard scalars under ``RUN_DIR/tensorboard`` and drives a tqdm progress bar (``advance()``).

    Args:
        flops_per_token: model FLOPs per trained token (forward + backward); enables TFLOP/s.
        peak_flops_per_s: peak of all devices together (per-device peak x world size); enables MFU.
        tensorboard: "auto" (when ``torch.utils.tensorboard`` imports), True (required) or False.
        device: where memory is measured (CUDA: torch's max allocated + NVML; always host RSS).
        print_fn: where lines go (default: ``tqdm.write`` so the progress bar stays intact).
        fp8: which GEMMs run in FP8 (``training.fp8_report.fp8_tag``), appended to every printed line.
    """

    def __init__(self, run_dir: str | os.PathLike, *, total_steps: int | None = None, start_step: int = 0,
                 flops_per_token: float | None = None, peak_flops_per_s: float | None = None,
                 device: Any = "cpu", tensorboard: bool | str = "auto", progress: bool = True,
                 print_fn: Callable[[str], None] | None = None, config: Mapping[str, Any] | None = None,
                 fp8: str | None = None) -> None:
        if tensorboard not in (True, False, "auto"):
            raise ValueError(f"tensorboard={tensorboard!r}: valid values are True, False, 'auto'")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps, self.flops_per_token, self.peak_flops_per_s = total_steps, flops_per_token, peak_flops_per_s
        self.device, self.fp8 = device, fp8
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._writer = self._open_tensorboard(tensorboard)
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", desc="train", dynamic_ncols=True,
                         disable=not progress, file=sys.stderr)
        self._print = print_fn or (self._bar.write if progress else print)
        self._last_time = time.perf_counter()
        self._write({"kind": "run", "schema": SCHEMA, "time": time.time(), "start_step": start_step,
                     "total_steps": total_steps, "flops_per_token": flops_per_token,
                     "peak_flops_per_s": peak_flops_per_s, "config": dict(config) if config else None,
                     "fp8": fp8})

    def _open_tensorboard(self, mode: bool | str):
        if mode is False:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            if mode is True:
                raise ImportError(f"TensorBoard logging needs the tensorboard package (pip install tensorboard): "
                                  f"{exc}") from exc
            return None
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def _write(self, rec: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(rec, allow_nan=False) + "\n")
        self._file.flush()

    def log(self, step: int, *, loss_lm: float, loss_aux: float | None = None, loss_z: float | None = None,
            loss_mtp: float | None = None, grad_norm: float | None = None, lr: float | None = None,
            tokens: int = 0, interval_s: float | None = None,
            tokens_per_expert: Sequence[Sequence[int]] | None = None,
            dropped_fraction: Sequence[float] | None = None, moe_layers: Sequence[int] | None = None,
            skipped: bool = False, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Record one logging step; returns the record. ``interval_s`` defaults to the wall time since the
        previous ``log()`` (or construction); ``tokens`` and ``tokens_per_expert`` cover that interval.
        Values may be Python numbers or 0-d tensors; ``tokens_per_expert`` nested lists or a [layers, experts]
        tensor (already summed over the ranks that route)."""
        now = time.perf_counter()
        interval = float(interval_s) if interval_s is not None else now - self._last_time
        self._last_time = now
        losses = {"loss_lm": _finite(loss_lm), "loss_aux": _finite(loss_aux), "loss_z": _finite(loss_z),
                  "loss_mtp": _finite(loss_mtp)}
        given = [v for v in (loss_lm, loss_aux, loss_z, loss_mtp) if v is not None]
        tps = tokens / interval if interval > 0 and tokens else None
        tflops = tps * self.flops_per_token / 1e12 if tps and self.flops_per_token else None
        rec: dict[str, Any] = {
            "kind": "step", "schema": SCHEMA, "step": int(step), "time": time.time(), "interval_s": interval,
            "loss": _finite(sum(float(v) for v in given)), **losses,
            "grad_norm": _finite(grad_norm), "lr": _finite(lr), "tokens": int(tokens), "tokens_per_s": tps,
            "tflops_per_s": tflops,
            "mfu": tflops * 1e12 / self.peak_flops_per_s if tflops and self.peak_flops_per_s else None,
            "memory": self._memory(), "skipped": bool(skipped),
            "moe": self._moe(tokens_per_expert, dropped_fraction, moe_layers), "extra": _json_safe(dict(extra or {})),
        }
        self._write(rec)
        self._print(format_line(rec, self.total_steps) + (f" | {self.fp8}" if self.fp8 else ""))
        if self._writer is not None:
            self._tensorboard(rec)
        return rec

    def _memory(self) -> dict[str, float]:
        from moefold.training.metrics_hw import memory_stats

        return memory_stats(self.device)

    @staticmethod
    def _moe(tokens_per_expert, dropped_fraction, moe_layers) -> dict[str, Any] | None:
        if tokens_per_expert is None:
            return None
        counts = [[int(c) for c in layer] for layer in tokens_per_expert]
        layers = list(moe_layers) if moe_layers is not None else list(range(len(counts)))
        dropped = [float(d) for d in dropped_fraction] if dropped_fraction is not None else [0.0] * len(counts)
        if not len(layers) == len(dropped) == len(counts):
            raise ValueError(f"tokens_per_expert has {len(counts)} layers, dropped_fraction {len(dropped)}, "
                             f"moe_layers {len(layers)}; give one entry per MoE layer")
        balance = load_balance(counts)
        scored = [(b, layer) for b, layer in zip(balance, layers) if b is not None]
        return {"layers": layers, "tokens_per_expert": counts, "dropped_fraction": dropped,
                "max_over_mean": balance, "worst_layer": max(scored)[1] if scored else None}

    def _tensorboard(self, rec: Mapping[str, Any]) -> None:
        step = rec["step"]
        for key in ("loss", "loss_lm", "loss_aux", "loss_z", "loss_mtp", "grad_norm", "lr", "tokens_per_s",
                    "tflops_per_s", "mfu"):
            if rec.get(key) is not None:
                group = "loss" if key.startswith("loss") else "perf" if key in ("tokens_per_s", "tflops_per_s",
                                                                                  "mfu") else "train"
                self._writer.add_scalar(f"{group}/{key}", rec[key], step)
        for key, value in rec["memory"].items():
            self._writer.add_scalar(f"memory/{key}", value, step)
        moe = rec.get("moe")
        if moe:
            for layer, b, d in zip(moe["layers"], moe["max_over_mean"], moe["dropped_fraction"]):
                if b is not None:
                    self._writer.add_scalar(f"moe_max_over_mean/layer{layer:02d}", b, step)
                self._writer.add_scalar(f"moe_dropped_fraction/layer{layer:02d}", d, step)

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar (call once per optimizer step)."""
        self._bar.update(steps)

    def close(self) -> None:
        self._bar.close()
        if self._writer is not None:
            self._writer.close()
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
