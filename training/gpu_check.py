"""One GPU check: install what can be installed, run tests/gpu and the GPU benchmarks, write one report.

    bash scripts/gpu_check.sh --out report.md            # from the repository, nothing prepared
    python -m moefold.training.gpu_check --out report.md  # where moefold is installed

On a machine with NVIDIA GPU(s) it runs, in order, each step a subprocess in its own process
group with its own timeout inside one total budget (default 470 s, so that the whole check fits
8 minutes):

1. environment: GPUs, driver, torch, CUDA, ``moefold env``;
2. install: the ``.[gpu]`` parts that are missing (Transformer Engine, grouped_gemm with ``pip
   --no-build-isolation``, from ``--wheels DIR`` when given, else the package index; DeepEP from
   ``--deepep-src DIR`` with >= 2 GPUs), each with a short timeout, continuing when one fails
   (a machine without network fails them in seconds);
3. tests: ``pytest tests/gpu`` (DeepEP's multi-GPU test in a pytest process of its own);
4. benchmarks: the MoE layer in bf16 per GEMM backend against a dense bf16 matmul of the same
   FLOPs; ``bench-dispatch`` over NCCL with >= 2 GPUs; a proxy-recipe training run (tokens/s,
   TFLOP/s, MFU from its metrics); host syncs per MoE layer and per step under CUDA's sync
   debug mode next to moefold's CPU model.

A step that fails, times out or cannot run is recorded with the reason and the check goes on;
the Markdown report (``--out``) is rewritten after every step, so it exists even if the check is
killed, and the full output of every step goes to ``--log`` (default: next to the report).
Exit code: 0 when every step that ran passed, 1 otherwise; 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the checkout (training/ is a top-level folder)
GPU_PARTS = (("transformer_engine", "transformer-engine[pytorch]"), ("grouped_gemm", "grouped-gemm"))


@dataclasses.dataclass
class Step:
    """One step's outcome: status is passed | failed | timed out | skipped."""

    name: str
    status: str
    seconds: float = 0.0
    summary: str = ""
    output: str = ""


class Budget:
    """The check's total time; each step gets what is left after reserving the later steps' minimum."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.total = seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def for_step(self, cap: float, reserve: float = 0.0) -> float:
        return max(0.0, min(cap, self.left() - reserve))


def run(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None,
        cwd: Path = REPO) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own process group; (return code or None on timeout, output, seconds).

    Output goes through a file (not a pipe a stuck grandchild could hold open); on timeout the
    whole group is terminated, then killed.
    """
    t0 = time.monotonic()
    if timeout < 1:
        return None, "no time left in the budget", 0.0
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as out:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True)
        except OSError as err:
            return 127, f"cannot start {cmd[0]}: {err}", 0.0
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        out.seek(0)
        text = out.read()
    seconds = time.monotonic() - t0
    with log.open("a", encoding="utf-8") as f:
        f.write(f"\n===== $ {' '.join(cmd)}  (rc={rc}, {seconds:.1f} s)\n{text}\n")
    return rc, text, seconds


def _status(rc: int | None) -> str:
    return "timed out" if rc is None else ("passed" if rc == 0 else "failed")


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _table(text: str) -> str:
    """The Markdown table rows a benchmark printed."""
    return "\n".join(line for line in text.splitlines() if line.startswith("|"))


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.log = Path(args.log).resolve() if args.log else self.out.with_suffix(".log")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text(f"moefold GPU check, {dt.datetime.now(dt.timezone.utc).isoformat()}\n", encoding="utf-8")
        self.budget = Budget(args.budget)
        self.steps: list[Step] = []
        self.header = ""
        self.python = sys.executable
        self.num_gpus = 0

    # -- steps ------------------------------------------------------------------------------
    def step(self, fn: Callable[[], Step]) -> None:
        t0 = time.monotonic()
        try:
            result = fn()
        except Exception as err:  # the check itself must never stop: record and go on
            result = Step(fn.__name__, "failed", summary=f"the check's own code failed: {type(err).__name__}: {err}")
        result.seconds = result.seconds or time.monotonic() - t0
        self.steps.append(result)
        self.write()

    def cmd_step(self, name: str, cmd: list[str], cap: float, reserve: float = 0.0, summarize=_tail,
                 env: dict[str, str] | None = None) -> Step:
        timeout = self.budget.for_step(cap, reserve)
        if timeout < 5:
            return Step(name, "skipped", summary=f"not enough of the {self.budget.total:.0f} s budget left")
        rc, text, seconds = run(cmd, timeout, self.log, env)
        summary = summarize(text) if rc == 0 else _tail(text, 15)
        if rc is None:
            summary = f"timed out after {timeout:.0f} s\n{summary}"
        return Step(name, _status(rc), seconds, summary, _tail(text))

    def environment(self) -> Step:
        import torch

        self.num_gpus = torch.cuda.device_count()
        gpus = [torch.cuda.get_device_name(i) for i in range(self.num_gpus)]
        cap = torch.cuda.get_device_capability(0) if self.num_gpus else None
        smi = shutil.which("nvidia-smi")
        driver = ""
        if smi:
            _, text, _ = run([smi, "--query-gpu=driver_version,memory.total", "--format=csv,noheader"], 20, self.log)
            driver = text.strip().splitlines()[0] if text.strip() else ""
        _, commit, _ = run(["git", "rev-parse", "--short", "HEAD"], 10, self.log)
        self.header = (f"- GPUs: {self.num_gpus} x {gpus[0] if gpus else 'none'} (compute capability {cap}); "
                       f"driver, memory: {driver or 'unknown'}\n"
                       f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}, "
                       f"{platform.machine()}, {os.cpu_count()} CPUs\n"
                       f"- moefold commit {commit.strip().splitlines()[-1] if commit.strip() else 'unknown'}\n")
        return self.cmd_step("environment", [self.python, "-m", "moefold.training.cli", "env"], 60)

    def install(self) -> Step:
        lines, ok = [], True
        for module, spec in GPU_PARTS:
            if importlib.util.find_spec(module) is not None:
                lines.append(f"- {spec}: already installed")
                continue
            cmd = [self.python, "-m", "pip", "install", "--no-build-isolation", "--retries", "0", "--timeout", "10"]
            if self.args.wheels:
                cmd += ["--no-index", "--find-links", self.args.wheels]
            rc, text, seconds = run([*cmd, spec], self.budget.for_step(self.args.install_timeout, 300), self.log,
                                    {"MAX_JOBS": str(os.cpu_count() or 4)})
            ok = ok and rc == 0
            reason = "" if rc == 0 else ": " + (_tail(text, 1) or "no output")[:200]
            lines.append(f"- {spec}: {_status(rc)} in {seconds:.0f} s{reason}")
        if importlib.util.find_spec("deep_ep") is not None:
            lines.append("- DeepEP: already installed")
        elif not self.args.deepep_src:
            lines.append("- DeepEP: not installed (not on PyPI: pass --deepep-src DIR, a DeepEP v1.2.1 checkout)")
        elif self.num_gpus < 2:
            lines.append("- DeepEP: not built (its kernels need >= 2 GPUs; this machine has "
                         f"{self.num_gpus})")
        else:
            import torch

            major, minor = torch.cuda.get_device_capability(0)
            rc, text, seconds = run([self.python, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                                     self.args.deepep_src], self.budget.for_step(240, 300), self.log,
                                    {"TORCH_CUDA_ARCH_LIST": f"{major}.{minor}"})
            ok = ok and rc == 0
            lines.append(f"- DeepEP from {self.args.deepep_src}: {_status(rc)} in {seconds:.0f} s"
                         + ("" if rc == 0 else ": " + _tail(text, 1)[:200]))
        return Step("install", "passed" if ok else "failed", summary="\n".join(lines))

    def tests(self) -> Step:
        base = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            base += ["--timeout", "150"]
        # DeepEP forks its ranks: a pytest process that has not initialised CUDA
        deepep = self.cmd_step("tests/gpu/test_deepep.py", [*base, "tests/gpu/test_deepep.py"], 150, reserve=240)
        rest = self.cmd_step("tests/gpu", [*base, "tests/gpu", "--ignore=tests/gpu/test_deepep.py"], 200,
                             reserve=120)
        status = "passed" if deepep.status == rest.status == "passed" else (
            rest.status if rest.status != "passed" else deepep.status)
        summary = f"test_deepep.py: {_tail(deepep.summary, 1)}\nthe rest: {_tail(rest.summary, 1)}"
        return Step("tests", status, deepep.seconds + rest.seconds, summary,
                    f"{_tail(deepep.output, 20)}\n\n{rest.output}")

    def moe_layer(self) -> Step:
        return self.cmd_step("MoE layer bf16 vs dense", [self.python, "-m", "moefold.training.gpu_bench", "moe-layer"],
                             120, reserve=150, summarize=lambda t: "\n".join(
                                 [ln for ln in t.splitlines() if ln.startswith(("device", "bf16 matmul"))]
                                 + [_table(t)]))

    def dispatch(self) -> Step:
        if self.num_gpus < 2:
            return Step("bench-dispatch (NCCL)", "skipped",
                        summary=f"needs >= 2 GPUs, this machine has {self.num_gpus}")
        n = min(self.num_gpus, 8)
        results, ok, seconds = [], True, 0.0
        kinds = ["alltoall"] + (["flex"] if importlib.util.find_spec("deep_ep") is not None else [])
        for kind in kinds:
            torchrun = [self.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
            step = self.cmd_step(f"bench-dispatch {kind}", [
                *torchrun, "examples/bench_dispatch.py", "--dispatcher", kind, "--ep", str(n), "--dtype", "bf16",
                "--num-tokens", "8192", "--hidden", "4096", "--num-experts", str(8 * n), "--topk", "8",
                "--iters", "10"], 90, reserve=120, summarize=lambda t: _tail(t, 8))
            ok, seconds = ok and step.status == "passed", seconds + step.seconds
            results.append(f"**{kind}** ({step.status})\n```\n{step.summary}\n```")
        return Step("bench-dispatch (NCCL)", "passed" if ok else "failed", seconds, "\n".join(results))

    def training(self) -> Step:
        run_dir = Path(tempfile.mkdtemp(prefix="moefold-gpu-check-"))
        cmd = [self.python, "-m", "moefold.training.cli", "train", "--recipe", "qwen3_moe_proxy", "--device", "cuda",
               "--bf16", "--train-iters", "8", "--log-interval", "1", "--micro-batch-size", "1",
               "--global-batch-size", "8", "--seq-length", "4096", "--vocab-size", "16384", "--lr-warmup-iters", "2",
               "--no-save", "--no-balance-report", "--run-dir", str(run_dir)]
        step = self.cmd_step("proxy training", cmd, 180, reserve=60)
        records = []
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("kind") == "step":
                    records.append(rec)
        shutil.rmtree(run_dir, ignore_errors=True)
        if records:
            last = records[-3:]  # after warm-up: the last three steps

            def mean(key: str) -> float | None:
                vals = [r[key] for r in last if r.get(key) is not None]
                return sum(vals) / len(vals) if vals else None

            tps, tflops, mfu = mean("tokens_per_s"), mean("tflops_per_s"), mean("mfu")
            mem = last[-1].get("memory") or {}
            step.summary = (f"qwen3_moe_proxy (4 layers, 16 experts top-8, hidden 2048) bf16, 8 x 4096 tokens per "
                            f"step, world 1; mean of steps {last[0]['step']}-{last[-1]['step']}: "
                            f"{_fmt(tps, '.0f')} tokens/s, {_fmt(tflops, '.1f')} TFLOP/s, MFU {_fmt(mfu, '.3f')}; "
                            f"max allocated {_fmt(mem.get('max_allocated_gib'), '.1f')} GiB; "
                            f"loss {records[0]['loss_lm']:.3f} -> {records[-1]['loss_lm']:.3f}\n") + step.summary[-600:]
        return step

    def syncs(self) -> Step:
        return self.cmd_step("host syncs", [self.python, "-m", "moefold.training.gpu_bench", "syncs"], 90,
                             summarize=_table)

    # -- report -----------------------------------------------------------------------------
    def write(self) -> None:
        used = self.budget.total - self.budget.left()
        rows = "\n".join(f"| {s.name} | {s.status} | {s.seconds:.0f} |" for s in self.steps)
        body = "\n\n".join(f"## {s.name}: {s.status}\n\n{s.summary}\n\n<details><summary>output (tail)</summary>\n\n"
                           f"```\n{s.output}\n```\n</details>" for s in self.steps)
        text = (f"# moefold GPU check\n\n{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
                f"{used:.0f} s of a {self.budget.total:.0f} s budget; full output: `{self.log.name}`\n\n"
                f"{self.header}\n| step | result | seconds |\n|---|---|---|\n{rows}\n\n{body}\n")
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(self.out)


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moefold.training.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.md", help="the Markdown report (default gpu_check.md)")
    parser.add_argument("--log", default=None, help="all steps' output (default: the report's name with .log)")
    parser.add_argument("--budget", type=float, default=470.0, help="total seconds for every step (default 470)")
    parser.add_argument("--install-timeout", type=float, default=90.0, help="seconds per pip install (default 90)")
    parser.add_argument("--wheels", default=None, help="install the GPU parts from this folder of wheels (offline)")
    parser.add_argument("--deepep-src", default=None, help="a DeepEP v1.2.1 checkout to build (>= 2 GPUs)")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: install,tests,bench,train,syncs")
    args = parser.parse_args(argv)
    check = Check(args)
    skip = set(filter(None, args.skip.split(",")))
    check.step(check.environment)
    if check.num_gpus == 0:
        check.steps.append(Step("GPU", "failed", summary="no CUDA device: nothing to check"))
        check.write()
        print(f"report: {check.out}")
        return 2
    plan = (("install", check.install), ("tests", check.tests), ("bench", check.moe_layer), ("bench", check.dispatch),
            ("train", check.training), ("syncs", check.syncs))
    for key, fn in plan:
        if key not in skip:
            check.step(fn)
    print(f"report: {check.out}")
    return 0 if all(s.status in ("passed", "skipped") for s in check.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
