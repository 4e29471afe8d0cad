"""The printed lines of the metrics records (``training.observe.metrics``): a step record's one line (losses,
grad norm, lr, throughput, FLOP/s, MFU, memory, the worst MoE layer's load), a validation record's, and the
names of MoE layers on them and in TensorBoard (``layer 3`` / ``MTP 1``, ``layer03`` / ``mtp1``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FLOPS_UNITS = (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6), ("FLOP/s", 1.0))


def format_flops(flops_per_s: float) -> str:
    """FLOP/s in the unit that shows three significant digits: ``12.3 GFLOP/s`` for a tiny model on a CPU,
    ``412 TFLOP/s`` for a GPU (a fixed TFLOP/s printed 0.00 for the tiny recipes)."""
    unit, scale = next(((u, s) for u, s in FLOPS_UNITS if abs(flops_per_s) >= s), FLOPS_UNITS[-1])
    value = flops_per_s / scale
    return f"{value:.{2 if abs(value) < 10 else 1 if abs(value) < 100 else 0}f} {unit}"


def layer_label(layer: int, num_layers: int | None = None) -> str:
    """``layer 3``, or ``MTP 1`` for the first multi-token-prediction block (numbered after the ``num_layers``
    decoder layers)."""
    return f"MTP {layer - num_layers + 1}" if num_layers is not None and layer >= num_layers else f"layer {layer}"


def layer_tag(layer: int, num_layers: int | None = None) -> str:
    """The TensorBoard name of a MoE layer: ``layer03``, ``mtp1``."""
    return f"mtp{layer - num_layers + 1}" if num_layers is not None and layer >= num_layers else f"layer{layer:02d}"


def format_line(rec: Mapping[str, Any], total_steps: int | None = None, num_layers: int | None = None) -> str:
    """The one printed line of a step record (``num_layers``: the decoder's, to name the MTP blocks)."""
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
        parts.append(format_flops(rec["tflops_per_s"] * 1e12))
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    mem = rec.get("memory") or {}
    if "max_allocated_gib" in mem:
        dev = (f", dev {mem['device_used_gib']:.1f}/{mem['device_total_gib']:.0f} GiB"
               if "device_used_gib" in mem else "")
        parts.append(f"mem {mem['max_allocated_gib']:.2f} GiB max alloc{dev}")
    elif "peak_rss_gib" in mem:
        parts.append(f"peak rss {mem['peak_rss_gib']:.2f} GiB")
    elif "rss_gib" in mem:
        parts.append(f"rss {mem['rss_gib']:.2f} GiB")
    moe = rec.get("moe")
    if moe and moe.get("worst_layer") is not None:
        i = moe["layers"].index(moe["worst_layer"])
        dropped = max(moe["dropped_fraction"] or [0.0])
        planned = (f", micro-batch {moe['micro_max_over_mean']:.2f} (plan {moe['planned_max_over_mean']:g})"
                   if "planned_max_over_mean" in moe else "")
        parts.append(f"load max/mean {moe['max_over_mean'][i]:.2f} ({layer_label(moe['worst_layer'], num_layers)})"
                     + planned + (f", dropped {100 * dropped:.1f}%" if dropped > 0 else ""))
    if rec.get("skipped"):
        parts.append("SKIPPED (non-finite loss or grad norm)")
    return " | ".join(parts)


def format_validation_line(rec: Mapping[str, Any], total_steps: int | None = None) -> str:
    """The printed line of a validation record."""
    step = f"{rec['step']}/{total_steps}" if total_steps else str(rec["step"])
    ppl = "n/a" if rec.get("ppl") is None else f"{rec['ppl']:.3f}"
    return f"validation step {step} | lm loss {rec['loss_lm']:.4f} | ppl {ppl} | {rec['tokens']} tokens"
