"""``moefold balance-report RUN_DIR``: expert load-balance plots and summary from a run's metrics.

Reads ``RUN_DIR/metrics.jsonl`` (schema in ``training/observe/metrics.py``; this report uses the step
records' ``step`` and ``moe`` fields: ``layers``, ``tokens_per_expert`` [moe layer][expert],
``dropped_fraction`` [moe layer]) and writes, into ``RUN_DIR/balance_report/`` (or ``--out``):

- ``expert_load_heatmap.png``: per MoE layer, tokens per expert over steps as a multiple of the
  layer's mean (1 = balanced; red overloaded, dark blue an expert with no tokens, grey a record in
  which the layer routed nothing); 16 layers per
  page (``expert_load_heatmap_p2.png``, ... for deeper models)
- ``load_over_steps.png``: max/mean expert load per layer over steps, and the dropped fraction when any
  token was dropped (a dropless run has no such panel)
- ``summary.txt``: the text summary that is also printed: the worst layers by max/mean load over the
  last quarter of the records, dropped tokens (when any), and dead experts (no tokens over that window,
  and no tokens in any record)

Multi-token-prediction blocks are MoE layers numbered after the decoder's (``num_layers`` from the run
record's config); they are labelled ``MTP 1``, ``MTP 2``, ...
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moefold.training.observe.metric_lines import layer_label
from moefold.training.observe.metrics import METRICS_FILE, read_metrics

LAYERS_PER_PAGE = 16


@dataclass(frozen=True)
class LoadHistory:
    """Per MoE layer: ``counts[i]`` float [num_records, num_experts_i]; ``dropped`` [num_records, layers];
    ``num_layers``: the decoder's layers (MoE layers from there on are MTP blocks), None when unknown."""

    steps: np.ndarray
    layers: list[int]
    counts: list[np.ndarray]
    dropped: np.ndarray
    num_layers: int | None = None

    def label(self, i: int) -> str:
        return layer_label(self.layers[i], self.num_layers)

    @property
    def drops(self) -> bool:
        """Any routed copy was dropped (capacity); a dropless run has none."""
        return bool(self.dropped.size and np.nanmax(self.dropped) > 0)

    def relative(self, i: int) -> np.ndarray:
        """counts / per-record mean over experts (NaN where a record has no tokens), [records, experts]."""
        c = self.counts[i]
        mean = c.mean(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(mean > 0, c / np.where(mean > 0, mean, 1), np.nan)

    def max_over_mean(self) -> np.ndarray:
        """[records, layers], NaN where a record has no tokens."""
        # A record's row is all NaN (no tokens) or all finite, so a plain max keeps the NaN.
        return np.stack([self.relative(i).max(axis=1) for i in range(len(self.layers))], axis=1)


def load_history(metrics_path: str | Path) -> LoadHistory:
    """The MoE load data of a metrics JSONL; ValueError when it has none or its shapes change mid-run."""
    records = [r for r in read_metrics(metrics_path) if r.get("moe")]
    if not records:
        raise ValueError(f"{metrics_path}: no step record has MoE load data (a 'moe' field with "
                         "tokens_per_expert); was the model MoE and did the trainer pass it to MetricsLogger?")
    layers = list(records[0]["moe"]["layers"])
    for r in records:
        if list(r["moe"]["layers"]) != layers:
            raise ValueError(f"{metrics_path}: step {r['step']} has MoE layers {r['moe']['layers']}, earlier "
                             f"records {layers}; one report covers one model")
    counts = []
    for i in range(len(layers)):
        rows = [r["moe"]["tokens_per_expert"][i] for r in records]
        if len({len(x) for x in rows}) != 1:
            raise ValueError(f"{metrics_path}: layer {layers[i]} changes its number of experts between records")
        counts.append(np.asarray(rows, dtype=float))
    dropped = np.asarray([r["moe"]["dropped_fraction"] for r in records], dtype=float)
    configs = [r["config"] for r in read_metrics(metrics_path, kind="run") if isinstance(r.get("config"), dict)]
    model = configs[-1].get("model") if configs else None
    num_layers = model.get("num_layers") if isinstance(model, dict) else None
    return LoadHistory(np.asarray([r["step"] for r in records]), layers, counts, dropped, num_layers)


def summarize(h: LoadHistory, source: str = "") -> str:
    """The text summary (see the module docstring)."""
    n = len(h.steps)
    window = max(1, n // 4)
    mom = h.max_over_mean()
    with np.errstate(all="ignore"):
        recent = np.nanmean(mom[-window:], axis=0)
    experts = sorted({c.shape[1] for c in h.counts})
    lines = [f"moefold balance report{': ' + source if source else ''}",
             f"steps {h.steps[0]}..{h.steps[-1]} ({n} records), {len(h.layers)} MoE layers x "
             f"{'/'.join(map(str, experts))} experts",
             f"max/mean expert load (1.00 = balanced), mean over the last {window} record(s), and the last value:"]
    order = sorted(range(len(h.layers)), key=lambda i: -np.nan_to_num(recent[i], nan=-1))
    width = max(len(h.label(i)) for i in range(len(h.layers)))
    for i in range(len(h.layers)):
        lines.append(f"  {h.label(i):>{width}}: {recent[i]:6.2f}  (last {mom[-1, i]:.2f})")
    worst = [f"{h.label(i)} ({recent[i]:.2f})" for i in order[:3] if not np.isnan(recent[i])]
    lines.append(f"worst layers: {', '.join(worst) or 'n/a (no tokens routed)'}")
    if h.drops:
        r, c = np.unravel_index(int(np.argmax(h.dropped)), h.dropped.shape)
        lines.append(f"dropped fraction: mean {100 * h.dropped.mean():.2f}%, max {100 * h.dropped[r, c]:.2f}% "
                     f"({h.label(c)}, step {h.steps[r]})")
    for label, rows in ((f"dead experts (no tokens over the last {window} record(s))", slice(n - window, n)),
                        ("never-used experts (no tokens in any record)", slice(0, n))):
        dead = {h.label(i): np.flatnonzero(h.counts[i][rows].sum(axis=0) == 0).tolist()
                for i in range(len(h.layers))}
        dead = {k: v for k, v in dead.items() if v}
        text = "; ".join(f"{k}: {v}" for k, v in dead.items()) if dead else "none"
        lines.append(f"{label}: {text}")
    return "\n".join(lines) + "\n"


def plot_heatmaps(h: LoadHistory, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    paths = []
    vmax = max(2.0, float(np.nanmax([np.nanmax(h.relative(i)) if np.isfinite(h.relative(i)).any() else 1.0
                                     for i in range(len(h.layers))])))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax)
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.25")
    for page, start in enumerate(range(0, len(h.layers), LAYERS_PER_PAGE)):
        idx = list(range(start, min(start + LAYERS_PER_PAGE, len(h.layers))))
        cols = min(4, len(idx))
        rows = -(-len(idx) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + 1.2, 3.0 * rows + 0.6), squeeze=False,
                                 constrained_layout=True)
        mesh = None
        for ax, i in zip(axes.flat, idx):
            rel = h.relative(i)
            experts = np.arange(rel.shape[1])
            mesh = ax.pcolormesh(h.steps, experts, np.ma.masked_invalid(rel.T), cmap=cmap, norm=norm,
                                 shading="nearest")
            ax.set_title(h.label(i), fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel("expert")
        for ax in list(axes.flat)[len(idx):]:
            ax.axis("off")
        fig.colorbar(mesh, ax=axes, label="tokens / layer mean (1 = balanced)", shrink=0.9)
        fig.suptitle("Tokens per expert over steps")
        path = out_dir / ("expert_load_heatmap.png" if page == 0 else f"expert_load_heatmap_p{page + 1}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_over_steps(h: LoadHistory, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mom = h.max_over_mean()
    if h.drops:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, constrained_layout=True)
    else:   # dropless: a panel of zeros says nothing
        fig, ax1 = plt.subplots(1, 1, figsize=(9, 4), constrained_layout=True)
        ax2 = None
    many = len(h.layers) > 10
    for i in range(len(h.layers)):
        kw = {"lw": 1.0, "alpha": 0.6} if many else {"lw": 1.5, "label": h.label(i)}
        ax1.plot(h.steps, mom[:, i], **kw)
        if ax2 is not None:
            ax2.plot(h.steps, 100 * h.dropped[:, i], **kw)
    if many:
        with np.errstate(all="ignore"):
            ax1.plot(h.steps, np.nanmax(mom, axis=1), color="k", lw=2, label="worst layer")
        if ax2 is not None:
            ax2.plot(h.steps, 100 * h.dropped.max(axis=1), color="k", lw=2, label="worst layer")
    ax1.axhline(1.0, color="0.5", ls="--", lw=1)
    ax1.set_ylabel("max / mean expert load")
    ax1.set_title("Expert load imbalance (1 = balanced)")
    (ax2 or ax1).set_xlabel("step")
    if ax2 is not None:
        ax2.set_ylabel("dropped tokens (%)")
        ax2.set_title("Dropped fraction (capacity overflow)")
    for ax in (ax1, ax2) if ax2 is not None else (ax1,):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2 if len(h.layers) > 4 and not many else 1)
    path = out_dir / "load_over_steps.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(run_dir: str | Path, metrics: str | Path | None = None, out: str | Path | None = None) -> list[Path]:
    """Write the PNGs and summary.txt; returns their paths (summary last)."""
    run_dir = Path(run_dir)
    metrics_path = Path(metrics) if metrics else run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path}: no metrics file (a training run writes RUN_DIR/{METRICS_FILE})")
    h = load_history(metrics_path)
    out_dir = Path(out) if out else run_dir / "balance_report"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [*plot_heatmaps(h, out_dir), plot_over_steps(h, out_dir)]
    summary = out_dir / "summary.txt"
    summary.write_text(summarize(h, str(metrics_path)))
    return [*paths, summary]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help=f"the run directory (holding {METRICS_FILE})")
    parser.add_argument("--metrics", help=f"metrics JSONL to read (default: RUN_DIR/{METRICS_FILE})")
    parser.add_argument("--out", help="output directory (default: RUN_DIR/balance_report)")


def main(args: argparse.Namespace) -> int:
    try:
        paths = report(args.run_dir, args.metrics, args.out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"moefold balance-report: error: {exc}")
        return 2
    print(paths[-1].read_text(), end="")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
