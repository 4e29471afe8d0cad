"""Training steps at a proxy size for the GPU check: each row is one ``moefold train`` run, made in this process
(the command printed beside it: the same flags, parsed by the same parser, through the same ``main``), its step
records read back from its ``metrics.jsonl``, and ``moefold plan``'s prediction for the same run beside it.

    python -m moefold.tools.gpu.train_rows --rows bf16,offload-activations,offload-optimizer,deepseek-v3
    python -m moefold.tools.gpu.train_rows --rows bf16 --compile
    python -m moefold.tools.gpu.train_rows --rows bf16,fp8-tensorwise,fp8-rowwise
    python -m moefold.tools.gpu.train_rows --device cpu --size tiny --rows ...      # the rehearsal

Rows (``ROWS``), at ``--size proxy`` (one H200): ``bf16`` is Qwen3-MoE's proxy (``qwen3_moe_proxy``: the true
hidden 2048, expert FFN 768, top-8, 4 layers of 16 experts) at 8 x 4096 tokens per step, vocabulary 16384 (the
built-in corpus's); ``offload-activations`` adds ``--fine-grained-activation-offloading --offload-modules core_attn
expert_fc1`` (the heavy modules docs/memory.md names), ``offload-optimizer`` ``--optimizer-cpu-offload`` (all of
the optimizer's states on the host); ``deepseek-v3`` is DeepSeek-V3's proxy (hidden 7168, MLA, MTP, 16 experts)
with 2 layers (one dense, one MoE) at 4 x 4096 tokens; ``fp8-tensorwise`` / ``fp8-rowwise`` are ``bf16`` with
torchao's FP8 recipes (``--fp8-format e4m3 --fp8-recipe ...``: the linears and the experts). ``--size tiny``
runs the same rows with the tiny recipes at 2 x 32 tokens (the rehearsal on the CPU).

Each row prints tokens/s, TFLOP/s, MFU and the step time (means over the steps after ``WARMUP``: the first
allocates the optimizer's states and warms the allocator and the kernels), the peak device memory (the largest of
the trainer's per-step ``max_allocated_gib``; CUDA only) beside ``moefold plan``'s total and activations for the
same model, batch and savers (``moefold plan`` run after the row in this process: the planner needs no GPU; it
does not model FP8),
the LM loss of the first and last step, and against the ``bf16`` row when it ran: the step-time ratio, the peak
ratio (savers) and the largest per-step loss difference (FP8). A row fails when its run fails, logs no step, or
logs a non-finite loss (reported, the other rows still run); the exit code is then 1. ``--deadline S``: no row
starts after S seconds (it prints a "skipped: out of time" row), so a caller's timeout never cuts the table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moefold.tools.gpu.steps import fmt
from moefold.training.cli import main as cli_main

WARMUP = 2
COMMON = ("--bf16", "--log-interval", "1", "--lr-warmup-iters", "2", "--no-save", "--no-balance-report")
# size -> model -> (flags that moefold plan takes too: model and batch; flags of the run alone)
MODELS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "proxy": {
        "qwen3": (("--recipe", "qwen3_moe_proxy", "--vocab-size", "16384", "--seq-length", "4096",
                   "--micro-batch-size", "1", "--global-batch-size", "8"), ("--train-iters", "6")),
        "deepseek": (("--recipe", "deepseek_v3_proxy", "--num-layers", "2", "--vocab-size", "16384", "--seq-length",
                      "4096", "--micro-batch-size", "1", "--global-batch-size", "4"), ("--train-iters", "5")),
    },
    "tiny": {
        "qwen3": (("--recipe", "qwen3_moe_tiny", "--vocab-size", "512", "--seq-length", "32", "--micro-batch-size",
                   "1", "--global-batch-size", "2"), ("--train-iters", "2")),
        "deepseek": (("--recipe", "deepseek_v3_tiny", "--vocab-size", "512", "--seq-length", "32",
                      "--micro-batch-size", "1", "--global-batch-size", "2"), ("--train-iters", "2")),
    },
}
# row -> (model, memory-saver flags (moefold plan takes them too), FP8 flags)
ROWS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "bf16": ("qwen3", (), ()),
    "offload-activations": ("qwen3", ("--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                                      "expert_fc1"), ()),
    "offload-optimizer": ("qwen3", ("--optimizer-cpu-offload",), ()),
    "deepseek-v3": ("deepseek", (), ()),
    "fp8-tensorwise": ("qwen3", (), ("--fp8-format", "e4m3", "--fp8-recipe", "tensorwise")),
    "fp8-rowwise": ("qwen3", (), ("--fp8-format", "e4m3", "--fp8-recipe", "rowwise")),
}
WORLD1 = ("--gpus", "1", "--cluster", "h200", "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
          "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size",
          "1")
GB_PER_GIB = 2 ** 30 / 1e9


@dataclass
class Measured:
    """One row's run: its step records (kind "step" of metrics.jsonl) and how it ended."""

    rc: int
    records: list[dict]
    error: str = ""

    def losses(self) -> list[float | None]:
        return [r.get("loss_lm") for r in self.records]

    def mean(self, key: str) -> float | None:
        """Mean of ``key`` over the steps after the warm-up (the last step when there are no more)."""
        timed = self.records[WARMUP:] or self.records[-1:]
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else None

    def peak_gib(self) -> float | None:
        peaks = [(r.get("memory") or {}).get("max_allocated_gib") for r in self.records]
        peaks = [p for p in peaks if p is not None]
        return max(peaks) if peaks else None

    def verdict(self) -> str:
        if self.rc != 0:
            return f"failed: moefold train exited {self.rc}: {self.error[:160]}"
        if not self.records:
            return "failed: no step records in metrics.jsonl"
        bad = [r["step"] for r in self.records if not isinstance(r.get("loss_lm"), (int, float))]
        return f"failed: non-finite loss at step {bad[0]}" if bad else "passed"


def train_argv(row: str, size: str, device: str, run_dir: str, compile: bool) -> list[str]:
    model, savers, fp8 = ROWS[row]
    shared, own = MODELS[size][model]
    # compiled: 4 steps (the first compiles; the last two are timed)
    return ["train", *shared, *own, "--device", device, *COMMON, *savers, *fp8, "--run-dir", run_dir,
            *(["--compile", "--train-iters", "4"] if compile and size == "proxy" else ["--compile"] if compile else [])]


def plan_argv(row: str, size: str) -> list[str] | None:
    """moefold plan's flags for the row's run (None for FP8 rows: the planner does not model FP8)."""
    model, savers, fp8 = ROWS[row]
    return None if fp8 else ["plan", *MODELS[size][model][0], *savers, *WORLD1]


def run_row(argv: list[str], device: str) -> Measured:
    """``moefold train argv`` in this process; its step records."""
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    gc.collect()
    if device == "cuda":   # the previous row's memory is gone, and not counted in this row's peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rc, error = 0, ""
    try:
        rc = cli_main(argv)
    except SystemExit as exc:   # argparse refusing a flag
        rc, error = (exc.code if isinstance(exc.code, int) else 2), "its flags were refused"
    except Exception as exc:   # one row's failure is its row; the other rows still run
        rc, error = 1, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    metrics = run_dir / "metrics.jsonl"
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "step"] \
        if metrics.exists() else []
    return Measured(rc, records, error or ("see its output above" if rc else ""))


def run_plan(argv: list[str]) -> dict[str, str]:
    """``moefold plan argv`` in this process (the planner needs no device; its output goes to the log); its
    figures, or {} when it printed none."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            cli_main(argv)
    except (SystemExit, Exception) as exc:   # the row stays; its plan cell says "-"
        out.write(f"moefold plan failed: {type(exc).__name__}: {exc}\n")
    print(out.getvalue(), end="", flush=True)
    return plan_figures(out.getvalue())


def plan_figures(text: str) -> dict[str, str]:
    """The memory figures (GB) of the one layout ``moefold plan`` printed with every layout flag fixed: its
    table's memory columns (params grads optim activ buffer total host stage) by name."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.lstrip().startswith("#") and "|" in line:
            names, values = line.split("|")[1].split(), lines[i + 1].split("|")
            return dict(zip(names, values[1].split())) if len(values) > 1 else {}
    return {}


def describe(row: str, m: Measured, plan: dict[str, str], base: Measured | None, compile: bool) -> str:
    losses = m.losses()

    def loss(x: float | None) -> str:
        return "non-finite" if x is None else f"{x:.3f}"

    vs = ""
    if base is not None and base is not m and base.records and m.records and (ROWS[row][1] or ROWS[row][2]):
        t, t0 = m.mean("interval_s"), base.mean("interval_s")
        vs = f"{t / t0:.2f}x time" if t and t0 else ""
        p, p0 = m.peak_gib(), base.peak_gib()
        if ROWS[row][1] and p and p0:
            vs += f", {p / p0:.2f}x peak"
        if ROWS[row][2]:
            pairs = [(a, b) for a, b in zip(losses, base.losses()) if a is not None and b is not None]
            vs += f", max loss diff {max(abs(a - b) for a, b in pairs):.3f}" if pairs else ""
    peak = m.peak_gib()
    planned = f"{plan['total']} ({plan.get('activ', '?')} activations)" if plan else "-"
    peak_s = "n/a (CPU)" if peak is None else f"{peak * GB_PER_GIB:.1f}"
    with contextlib.suppress(ValueError, ZeroDivisionError, KeyError):   # a plan figure "-" or 0.0, or none
        peak_s += f" ({peak * GB_PER_GIB / float(plan['total']):.2f}x plan)" if peak is not None and plan else ""
    name = row + (" --compile" if compile else "")
    figures = (f"{fmt(m.mean('tokens_per_s'), '.0f')} | {fmt(m.mean('tflops_per_s'), '.3g')} | "
               f"{fmt(m.mean('mfu'), '.3f')} | {fmt(m.mean('interval_s'), '.3f')}")
    return (f"| {name} | {figures} | {vs} | {peak_s} | {planned} | "
            f"{loss(losses[0]) if losses else '-'} -> {loss(losses[-1]) if losses else '-'} | {m.verdict()} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m moefold.tools.gpu.train_rows",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(MODELS), default="proxy")
    parser.add_argument("--rows", default="bf16", help=f"comma-separated, any of {', '.join(ROWS)}")
    parser.add_argument("--compile", action="store_true", help="every row with --compile")
    parser.add_argument("--no-plan", action="store_true", help="leave out moefold plan's prediction")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which no row starts")
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows {','.join(unknown)}: valid rows are {', '.join(ROWS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (--device cpu --size tiny rehearses the same rows on the CPU)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.deadline
    print("| row | tokens/s | TFLOP/s | MFU | step s | vs bf16 | peak GB (measured) | moefold plan GB | "
          "LM loss first -> last | result |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results: dict[str, Measured] = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="moefold-train-rows-") as tmp:
        for row in rows:
            if time.monotonic() > deadline:
                print(f"| {row} | skipped: out of time (--deadline {args.deadline:.0f} s) |" + " |" * 8, flush=True)
                continue
            t_argv = train_argv(row, args.size, args.device, str(Path(tmp) / row), args.compile)
            print(f"command {row}: python -m moefold.training.cli {' '.join(t_argv)}", flush=True)
            results[row] = run_row(t_argv, args.device)
            plan: dict[str, str] = {}
            if not args.no_plan and (p_argv := plan_argv(row, args.size)) is not None:
                plan = run_plan(p_argv)
                print(f"plan {row}: python -m moefold.training.cli {' '.join(p_argv)}"
                      + ("" if plan else " (no figures: see the log)"), flush=True)
            failed = failed or results[row].verdict() != "passed"
            print(describe(row, results[row], plan, results.get("bf16"), args.compile), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
