"""Per-logging-step metrics: one printed line, a JSONL record, TensorBoard scalars, a progress bar.

Only the logging rank (rank 0) builds a ``MetricsLogger``; every value handed to it must already be
global (reduced over the ranks that own it), so nothing here crosses ranks.

JSONL schema (``RUN_DIR/metrics.jsonl``, one JSON object per line, appended across resumes)
------------------------------------------------------------------------------------------
A run record, written when a logger opens::

    {"kind": "run", "schema": 1, "time": <unix s>, "start_step": int, "total_steps": int | null,
     "flops_per_token": float | null, "peak_flops_per_s": float | null, "config": {...} | null,
     "peak_flops_source": str | null,  # where the peak comes from (observe.hardware.device_peak): a data-sheet
                                       #   row, or the per-machine measurement every run here divides by
     "fp8": str | null}               # which GEMMs run in FP8 (training.observe.fp8_report.fp8_tag), also on every line

A step record per logging step (``null``: not measured, or not finite)::

    {"kind": "step", "schema": 1, "step": int, "time": <unix s>, "interval_s": float,
     "loss": float,                  # lm + aux + z + mtp (those given)
     "loss_lm": float, "loss_aux": float|null, "loss_z": float|null, "loss_mtp": float|null,
     "grad_norm": float|null, "lr": float|null,
     "tokens": int,                  # tokens trained since the previous step record (all ranks)
     "tokens_per_s": float|null, "tflops_per_s": float|null, "mfu": float|null,
     "memory": {"rss_gib": f,        # host process now
                "max_allocated_gib": f, "device_used_gib": f, "device_total_gib": f,   # CUDA: peak since
                "peak_rss_gib": f},     #   the previous record; CPU: peak resident set since then (Linux
                                        #   VmHWM, reset per record; elsewhere since the process started)
     "skipped": bool,                # the optimizer step was skipped (non-finite loss/grad norm)
     "moe": null | {
        "layers": [int, ...],        # model layer number of each MoE layer, in the order below
        "tokens_per_expert": [[int, ...], ...],  # [moe layer][expert]: routed token copies (top-k
                                     #   counted k times) since the previous record, all ranks
        "dropped_fraction": [float, ...],  # [moe layer]: dropped copies / routed copies (capacity)
        "max_over_mean": [float|null, ...],  # [moe layer]: max / mean of tokens_per_expert
        "worst_layer": int|null,     # layer number with the largest max_over_mean
        "micro_max_over_mean": float,     # with --moe-max-load-ratio: the worst micro-batch's max/mean over its
        "planned_max_over_mean": float,   #   dispatch group since the previous record, and the planned ratio
        "router": {                  # per layer, means over the steps since the previous record
            "<loss name>": [float, ...],  # each enabled router loss, unweighted (aux_loss, seq_aux_loss,
                                     #   global_aux_loss, z_loss): the micro-batch value, as in loss_aux
            "entropy": [float, ...], # mean router entropy per token, nats (ln E = uniform)
        },                           # (absent when the caller gives none)
     },
     "extra": {...}}                 # anything else the caller passed

A validation record per evaluation (``--eval-interval``, and at the end of a run)::

    {"kind": "valid", "schema": 1, "step": int, "time": <unix s>, "loss_lm": float, "ppl": float|null,
     "tokens": int}                  # tokens evaluated

A logger that opens at ``start_step`` (a resumed run) first drops the step records after ``start_step``
(logged by the run it resumes after that run's last checkpoint), so every step has one record.
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

from moefold.training.observe.metric_lines import format_line, format_validation_line, layer_tag

SCHEMA = 1
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


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


def drop_steps_after(path: str | os.PathLike, step: int) -> int:
    """Rewrite the metrics JSONL ``path`` without its step records after ``step`` (atomically); returns how many
    were dropped. Lines that are not JSON (a last line cut short by a crash) go too."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += bool(line.strip())
                continue
            if rec.get("kind") == "step" and int(rec["step"]) > step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return dropped


class MetricsLogger:
    """Writes ``RUN_DIR/metrics.jsonl`` (see the module docstring), prints one line per ``log()``, adds
    TensorBoard scalars under ``RUN_DIR/tensorboard`` and drives a tqdm progress bar (``advance()``).

    Args:
        flops_per_token: model FLOPs per trained token (forward + backward); enables FLOP/s.
        peak_flops_per_s: peak of all devices together (per-device peak x world size); enables MFU.
        peak_flops_source: where that peak comes from (``observe.hardware.PeakFlops.source``), for the run record.
        tensorboard: "auto" (when ``torch.utils.tensorboard`` imports), True (required) or False. One directory
            per run, ``RUN_DIR/tensorboard``: a run that starts at step 0 removes the event files of the run it
            replaces (as it drops that run's step records), a resumed run adds its own file, from which
            TensorBoard drops the steps it redoes (``purge_step``).
        progress: draw a tqdm progress bar (``advance()``) on stderr; None: only when stderr is a terminal.
        drop_later_steps: drop the step records (and event files) after ``start_step`` that an earlier run left
            here (False: a validation-only run, which trains no step).
        device: where memory is measured (CUDA: torch's max allocated + NVML; always host RSS).
        print_fn: where lines go (default: ``tqdm.write`` so the progress bar stays intact).
        wandb: ``{"project": ..., "name": ..., "dir": ...}`` to also log every scalar to Weights & Biases
            (the optional ``wandb`` package, imported only then; ``WANDB_MODE=offline`` needs no network).
        fp8: which GEMMs run in FP8 (``training.observe.fp8_report.fp8_tag``), appended to every printed line.
    """

    def __init__(self, run_dir: str | os.PathLike, *, total_steps: int | None = None, start_step: int = 0,
                 flops_per_token: float | None = None, peak_flops_per_s: float | None = None,
                 device: Any = "cpu", tensorboard: bool | str = "auto", progress: bool | None = None,
                 print_fn: Callable[[str], None] | None = None, config: Mapping[str, Any] | None = None,
                 wandb: Mapping[str, Any] | None = None, fp8: str | None = None,
                 drop_later_steps: bool = True, peak_flops_source: str | None = None) -> None:
        if tensorboard not in (True, False, "auto"):
            raise ValueError(f"tensorboard={tensorboard!r}: valid values are True, False, 'auto'")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps, self.flops_per_token, self.peak_flops_per_s = total_steps, flops_per_token, peak_flops_per_s
        self.device, self.fp8 = device, fp8
        model = (config or {}).get("model")
        self.num_layers = model.get("num_layers") if isinstance(model, Mapping) else None
        if progress is None:
            progress = sys.stderr.isatty()
        dropped = drop_steps_after(self.path, start_step) if drop_later_steps else 0
        replaced = self._drop_event_files() if drop_later_steps and start_step == 0 and tensorboard else 0
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._writer = self._open_tensorboard(tensorboard, start_step)
        self._wandb = self._open_wandb(wandb, config)
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", desc="train", dynamic_ncols=True,
                         disable=not progress, file=sys.stderr)
        self._print = print_fn or (self._bar.write if progress else print)
        if dropped:
            self._print(f"{self.path}: dropped {dropped} records after step {start_step} (from an earlier run in "
                        "this directory, past the checkpoint this run starts from)")
        if replaced:
            self._print(f"{self.run_dir / TENSORBOARD_DIR}: removed {replaced} event file(s) of the earlier run in "
                        "this directory (this run starts at step 0; one TensorBoard run per directory)")
        self._last_time = time.perf_counter()
        self._write({"kind": "run", "schema": SCHEMA, "time": time.time(), "start_step": start_step,
                     "total_steps": total_steps, "flops_per_token": flops_per_token,
                     "peak_flops_per_s": peak_flops_per_s, "peak_flops_source": peak_flops_source,
                     "config": dict(config) if config else None, "fp8": fp8})

    def _open_tensorboard(self, mode: bool | str, start_step: int):
        if mode is False:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            if mode is True:
                raise ImportError(f"TensorBoard logging needs the tensorboard package (pip install tensorboard): "
                                  f"{exc}") from exc
            return None
        # purge_step: TensorBoard hides the earlier run's events from the resumed step on (no duplicate points)
        return SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=start_step + 1)

    def _drop_event_files(self) -> int:
        """Remove the TensorBoard event files an earlier run left in this run directory; how many."""
        files = list((self.run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
        for f in files:
            f.unlink()
        return len(files)

    def _open_wandb(self, settings: Mapping[str, Any] | None, config: Mapping[str, Any] | None):
        if not settings:
            return None
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(f"--wandb-project needs the wandb package (pip install wandb): {exc}") from exc
        return wandb.init(project=settings["project"], name=settings.get("name"),
                          dir=str(settings.get("dir") or self.run_dir), config=dict(config) if config else None)

    def _write(self, rec: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(rec, allow_nan=False) + "\n")
        self._file.flush()

    def log(self, step: int, *, loss_lm: float, loss_aux: float | None = None, loss_z: float | None = None,
            loss_mtp: float | None = None, grad_norm: float | None = None, lr: float | None = None,
            tokens: int = 0, interval_s: float | None = None,
            tokens_per_expert: Sequence[Sequence[int]] | None = None,
            dropped_fraction: Sequence[float] | None = None, moe_layers: Sequence[int] | None = None,
            skipped: bool = False, extra: Mapping[str, Any] | None = None,
            router: Mapping[str, Sequence[float | None]] | None = None,
            received_per_expert: Sequence[Sequence[int]] | None = None,
            load_ratio: tuple[float, float] | None = None) -> dict[str, Any]:
        """Record one logging step; returns the record. ``interval_s`` defaults to the wall time since the
        previous ``log()`` (or construction); ``tokens`` and ``tokens_per_expert`` cover that interval.
        Values may be Python numbers or 0-d tensors; ``tokens_per_expert`` nested lists or a [layers, experts]
        tensor (already summed over the ranks that route); ``router`` per-layer router metrics
        (``router_layer_metrics``), in the order of ``moe_layers``; ``received_per_expert`` the copies each
        expert received as its dispatcher counted them (after capacity drops; DeepEP V2's), like
        ``tokens_per_expert``: logged with its own max/mean (``moe_received_max_over_mean``); ``load_ratio``: (the
        worst micro-batch's expert-load max/mean since the previous record, the planned one:
        ``training.observe.imbalance``)."""
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
            "moe": self._moe(tokens_per_expert, dropped_fraction, moe_layers, router, received_per_expert,
                             load_ratio),
            "extra": _json_safe(dict(extra or {})),
        }
        self._write(rec)
        self._print(format_line(rec, self.total_steps, self.num_layers) + (f" | {self.fp8}" if self.fp8 else ""))
        self._scalars_out(rec["step"], self._scalars(rec, self.num_layers))
        return rec

    def log_validation(self, step: int, *, loss_lm: float, ppl: float | None, tokens: int) -> dict[str, Any]:
        """Record one evaluation (``training.evaluate``): JSONL, a printed line, TensorBoard/W&B ``valid/*``."""
        rec = {"kind": "valid", "schema": SCHEMA, "step": int(step), "time": time.time(), "loss_lm": _finite(loss_lm),
               "ppl": _finite(ppl), "tokens": int(tokens)}
        self._write(rec)
        self._print(format_validation_line(rec, self.total_steps))
        self._scalars_out(rec["step"], {f"valid/{k}": rec[k] for k in ("loss_lm", "ppl") if rec[k] is not None})
        return rec

    def _scalars_out(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(dict(scalars), step=step)

    def _memory(self) -> dict[str, float]:
        from moefold.training.observe.hardware import memory_stats

        return memory_stats(self.device)

    @staticmethod
    def _moe(tokens_per_expert, dropped_fraction, moe_layers, router=None, received=None,
             load_ratio=None) -> dict[str, Any] | None:
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
        if router is not None:
            router = {name: [_finite(v) for v in values] for name, values in router.items()}
            bad = {name: len(values) for name, values in router.items() if len(values) != len(layers)}
            if bad:
                raise ValueError(f"router metrics {bad} do not have one entry per MoE layer ({len(layers)})")
        out = {"layers": layers, "tokens_per_expert": counts, "dropped_fraction": dropped,
               "max_over_mean": balance, "worst_layer": max(scored)[1] if scored else None}
        if router is not None:
            out["router"] = router
        if received is not None:
            received = [[int(c) for c in layer] for layer in received]
            if len(received) != len(layers):
                raise ValueError(f"received_per_expert has {len(received)} layers, expected {len(layers)}")
            out["received_per_expert"] = received
            out["received_max_over_mean"] = load_balance(received)
        if load_ratio is not None:
            out["micro_max_over_mean"], out["planned_max_over_mean"] = float(load_ratio[0]), float(load_ratio[1])
        return out

    @staticmethod
    def _scalars(rec: Mapping[str, Any], num_layers: int | None = None) -> dict[str, float]:
        """The TensorBoard / W&B scalars of a step record: losses, perf, memory, and per MoE layer its load
        balance, dropped fraction (when it drops any), router losses and entropy (``moe_<metric>/layerNN``,
        ``moe_<metric>/mtpK`` for the K-th MTP block)."""
        out: dict[str, float] = {}
        for key in ("loss", "loss_lm", "loss_aux", "loss_z", "loss_mtp", "grad_norm", "lr", "tokens_per_s",
                    "tflops_per_s", "mfu"):
            if rec.get(key) is not None:
                group = "loss" if key.startswith("loss") else "perf" if key in ("tokens_per_s", "tflops_per_s",
                                                                                  "mfu") else "train"
                out[f"{group}/{key}"] = rec[key]
        for key, value in rec["memory"].items():
            out[f"memory/{key}"] = value
        moe = rec.get("moe")
        if moe:
            per_layer = {"max_over_mean": moe["max_over_mean"], **(moe.get("router") or {})}
            if any(moe["dropped_fraction"]):
                per_layer["dropped_fraction"] = moe["dropped_fraction"]
            if "received_max_over_mean" in moe:
                per_layer["received_max_over_mean"] = moe["received_max_over_mean"]
            for metric, values in per_layer.items():
                for layer, value in zip(moe["layers"], values):
                    if value is not None:
                        out[f"moe_{metric}/{layer_tag(layer, num_layers)}"] = value
        return out

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar (call once per optimizer step)."""
        self._bar.update(steps)

    def close(self) -> None:
        self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
