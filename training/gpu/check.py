"""One GPU check: what needs nothing installed first, installs after, one report written after every step.

    bash scripts/gpu_check.sh --out report.md [--wheels DIR]   # from the repository, nothing prepared
    python -m moefold.training.gpu.check --out report.md        # where moefold is installed
    python -m moefold.training.gpu.check --rehearsal --out r.md # every step on the CPU, tiny sizes

Sized for the machine a GPU check meets: a lent GPU with no package index at all, whose Python has torch,
triton, nvcc and the ``nvidia-nvshmem`` wheel, and no Transformer Engine, grouped_gemm, DeepEP or torchao.
Each step is a subprocess in its own process group with its own timeout inside one total budget (default
440 s, clamped to the deadline ``scripts/gpu_check.sh`` sets, so the whole check fits 8 minutes), in order:

1. environment: GPUs, driver, torch, CUDA, ``moefold env``;
2. torch API: every torch name moefold calls resolves in this machine's torch and takes moefold's keywords
   (``training.gpu.torch_api``; the declared minimum is older than this machine's torch may be);
3. host syncs per MoE layer and per training step under CUDA's sync debug mode next to moefold's CPU model;
4. a proxy-recipe training run in bf16 (tokens/s, TFLOP/s, MFU from its metrics);
5. the MoE layer in bf16 with ``grouped_mm`` against a dense bf16 matmul of the same FLOPs;
6. ``pytest tests/gpu`` (tests of libraries that are not installed skip themselves);
7. ``--compile`` on CUDA: the proxy run compiled (its tokens/s) and ``tests/gpu/test_compile_cuda.py``;
8. install: wheels carried in ``--wheels DIR`` (``pip --no-index --no-deps`` into a site folder on
   ``PYTHONPATH``; torch is never reinstalled), the ``.[gpu]`` parts from an index only if one answers within
   seconds, DeepEP from ``--deepep-src DIR`` with >= 2 GPUs (V2 against an nvidia-nccl wheel >= 2.30.4;
   ``training.gpu.install``);
9. after install: the tests and MoE-layer rows of whatever the installs made importable (DeepEP's tests in a
   pytest process of their own, with >= 2 GPUs);
10. ``bench-dispatch`` over NCCL with >= 2 GPUs.

A step that fails, times out or cannot run is recorded with the reason and the check goes on; the Markdown
report (``--out``) is rewritten after every step, so it exists even if the check is killed, and the full output
of every step goes to ``--log`` (default: next to the report). Exit code: 0 when every step that ran passed, 1
otherwise; 2 without a CUDA device.

``--rehearsal`` runs every step on the CPU with tiny sizes (tests/gpu with ``MOEFOLD_GPU_REHEARSAL=1``:
see tests/gpu/rehearsal.py; the benchmarks with ``--device cpu``; installs from an index are not attempted,
carried wheels are), so that a stale call fails here rather than on the GPU machine's few minutes; ``--quick``
makes that a CI-sized run (tests/training/gpu/test_rehearsal.py): tests/gpu's quick subset, no compiles.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from moefold.training.gpu import install as gpu_install
from moefold.training.gpu.steps import (
    REPO,
    Budget,
    Step,
    fmt,
    last_lines,
    pytest_summary,
    run,
    status_of,
    table_rows,
    tail,
)

DEFAULT_INDEX = "https://pypi.org/simple/"
DEFAULT_BUDGET = 440.0  # seconds: the steps' reserves are sized for it
# tests/gpu in the order they run: quick and telling first; the compile test runs in the compile step
TEST_FILES = ("test_device_agnostic.py", "test_host_sync_cuda.py", "test_gemm_backends.py", "test_fp8_cuda.py",
              "test_cp_attention.py", "test_attention_sinks_cuda.py", "test_from_hf_cuda.py")
COMPILE_TEST = "test_compile_cuda.py"
# the tests and MoE-layer backends that an optional package, once importable, adds to what already ran
RERUN_TESTS = {"torchao": ("test_fp8_cuda.py",), "transformer_engine": ("test_gemm_backends.py", "test_fp8_cuda.py"),
               "grouped_gemm": ("test_gemm_backends.py",), "deep_ep": ("test_deepep.py",)}
RERUN_BACKENDS = {"transformer_engine": "te", "grouped_gemm": "grouped_gemm", "torchao": "grouped_mm"}


def rerun_plan(newly: frozenset[str]) -> tuple[list[str], list[str]]:
    """(tests/gpu files, MoE-layer backends) to run again because ``newly`` became importable."""
    files = sorted({f for m in newly for f in RERUN_TESTS.get(m, ())})
    backends = sorted({RERUN_BACKENDS[m] for m in newly if m in RERUN_BACKENDS})
    return files, backends


def deadline_budget(requested: float, deadline: str | None, now: float, margin: float = 15.0) -> float:
    """The budget, clamped to end ``margin`` s before ``deadline`` (epoch seconds, from gpu_check.sh)."""
    if not deadline:
        return requested
    return max(1.0, min(requested, float(deadline) - now - margin))


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rehearsal = args.rehearsal or args.quick
        self.device = "cpu" if self.rehearsal else "cuda"
        self.out = Path(args.out).resolve()
        self.log = Path(args.log).resolve() if args.log else self.out.with_suffix(".log")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text(f"moefold GPU check, {dt.datetime.now(dt.timezone.utc).isoformat()}\n", encoding="utf-8")
        total = deadline_budget(args.budget, os.environ.get("MOEFOLD_GPU_CHECK_DEADLINE"), time.time())
        self.budget = Budget(total, sized_for=DEFAULT_BUDGET)
        self.steps: list[Step] = []
        self.header = ""
        self.python = sys.executable
        self.num_gpus = 0
        # for every step's subprocess: PYTHONPATH with the carried wheels; CUDA availability through NVML in
        # pytest's parent so that its forked ranks can initialise CUDA (tests/distributed.py)
        self.env: dict[str, str] = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        self.cleanup: list[Path] = []  # folders removed when the check ends
        self.preinstalled = gpu_install.importable()
        if self.rehearsal:
            self.env["MOEFOLD_GPU_REHEARSAL"] = "quick" if args.quick else "1"

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

    def cmd_step(self, name: str, cmd: list[str], cap: float, reserve: float = 0.0, summarize=tail,
                 env: dict[str, str] | None = None) -> Step:
        timeout = self.budget.for_step(cap, reserve)
        if timeout < 5:
            return Step(name, "skipped", summary=f"not enough of the {self.budget.total:.0f} s budget left")
        rc, text, seconds = run(cmd, timeout, self.log, {**self.env, **(env or {})})
        summary = summarize(text) if rc == 0 else (summarize(text) + "\n" + tail(text, 15)).strip()
        if rc is None:
            summary = f"timed out after {timeout:.0f} s\n{summary}"
        return Step(name, status_of(rc), seconds, summary, tail(text))

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
        commit = commit.strip().splitlines()[-1] if commit.strip() else ""
        optional = ", ".join(sorted(self.preinstalled)) or "none"
        self.header = ((f"- **rehearsal on the CPU** ({'quick, ' if self.args.quick else ''}tiny sizes): "
                        f"the code paths, not GPU figures\n" if self.rehearsal else "")
                       + f"- GPUs: {self.num_gpus} x {gpus[0] if gpus else 'none'} (compute capability {cap}); "
                       f"driver, memory: {driver or 'unknown'}\n"
                       f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}, "
                       f"{platform.machine()}, {os.cpu_count()} CPUs; optional packages at the start: {optional}\n"
                       f"- moefold commit {commit if re.fullmatch(r'[0-9a-f]{4,40}', commit) else 'unknown'}; "
                       f"{os.environ.get('MOEFOLD_GPU_CHECK_INSTALL', 'run as python -m')}\n")
        return self.cmd_step("environment", [self.python, "-m", "moefold.training.cli", "env"], 45)

    def torch_api(self) -> Step:
        return self.cmd_step("torch API", [self.python, "-m", "moefold.training.gpu.torch_api"], 40, reserve=380,
                             summarize=lambda t: tail(t, 12))

    # measurements and tests (nothing installed) ---------------------------------------------------
    def syncs(self) -> Step:
        return self.cmd_step("host syncs", [self.python, "-m", "moefold.training.gpu.bench", "syncs", "--device",
                                            self.device], 60, reserve=330, summarize=table_rows)

    def training(self, compile: bool = False) -> Step:
        name = "proxy training --compile" if compile else "proxy training"
        run_dir = Path(tempfile.mkdtemp(prefix="moefold-gpu-check-"))
        iters = "4" if compile else "8"
        if self.rehearsal:
            recipe, sizes = "qwen3_moe_tiny", ["--train-iters", "3", "--micro-batch-size", "1", "--global-batch-size",
                                               "2", "--seq-length", "32", "--vocab-size", "512"]
        else:
            recipe, sizes = "qwen3_moe_proxy", ["--train-iters", iters, "--micro-batch-size", "1",
                                                "--global-batch-size", "8", "--seq-length", "4096", "--vocab-size",
                                                "16384"]
        cmd = [self.python, "-m", "moefold.training.cli", "train", "--recipe", recipe, "--device", self.device,
               "--bf16", *sizes, "--log-interval", "1", "--lr-warmup-iters", "2", "--no-save", "--no-balance-report",
               "--run-dir", str(run_dir), *(["--compile"] if compile else [])]
        step = self.cmd_step(name, cmd, 120 if compile else 100, reserve=60 if compile else 240)
        records = []
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("kind") == "step":
                    records.append(rec)
        shutil.rmtree(run_dir, ignore_errors=True)
        if records:
            last = records[-2:] if compile else records[-3:]  # after warm-up (and compiling)

            def mean(key: str) -> float | None:
                vals = [r[key] for r in last if r.get(key) is not None]
                return sum(vals) / len(vals) if vals else None

            tps, tflops, mfu = mean("tokens_per_s"), mean("tflops_per_s"), mean("mfu")
            mem = last[-1].get("memory") or {}
            tokens = last[-1].get("tokens")
            step.summary = (f"{recipe} bf16{' --compile' if compile else ''}, {tokens} tokens per step, world 1; "
                            f"mean of steps {last[0]['step']}-{last[-1]['step']}: {fmt(tps, '.0f')} tokens/s, "
                            f"{fmt(tflops, '.3g')} TFLOP/s, MFU {fmt(mfu, '.3f')}; max allocated "
                            f"{fmt(mem.get('max_allocated_gib'), '.1f')} GiB; "
                            f"loss {records[0]['loss_lm']:.3f} -> {records[-1]['loss_lm']:.3f}\n") + last_lines(
                                step.output, ("step ", "done:", "model:", "rank 0 memory", "torch.compile:"))
        elif step.status == "passed":
            step.status, step.summary = "failed", f"no step records in {metrics.name}\n{step.summary}"
        return step

    def moe_layer(self, backends: str = "grouped_mm", name: str = "MoE layer bf16 vs dense", cap: float = 80,
                  reserve: float = 170) -> Step:
        timeout = self.budget.for_step(cap, reserve)
        cmd = [self.python, "-m", "moefold.training.gpu.bench", "moe-layer", "--device", self.device,
               "--backends", backends, "--no-compile", "--deadline", str(max(1, int(timeout - 20)))]
        if self.rehearsal:
            cmd += ["--tokens", "64", "--configs", "8,2,32,64", "--iters", "1", "--warmup", "0", "--matmul-size", "64"]
        return self.cmd_step(name, cmd, cap, reserve=reserve, summarize=lambda t: "\n".join(
            [ln for ln in t.splitlines() if ln.startswith(("device", "bf16 matmul"))] + [table_rows(t)]))

    def _pytest(self, name: str, files: list[str], cap: float, reserve: float = 0.0) -> Step:
        base = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--durations=5"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            base += ["--timeout", "150"]
        return self.cmd_step(name, [*base, *(f"tests/gpu/{f}" for f in files)], cap, reserve=reserve,
                             summarize=pytest_summary)

    def tests(self) -> Step:
        parts: list[Step] = []
        deepep = importlib.util.find_spec("deep_ep") is not None
        if deepep and not self.rehearsal:
            # DeepEP forks its ranks: a pytest process of its own, one that has not initialised CUDA
            parts.append(self._pytest("test_deepep.py", ["test_deepep.py"], 120, reserve=200))
        # a rehearsal initialises no CUDA: DeepEP's test (its CPU stand-in) runs in the same process
        files = [*TEST_FILES, *(["test_deepep.py"] if self.rehearsal else [])]
        others = sorted({p.name for p in (REPO / "tests" / "gpu").glob("test_*.py")} - set(TEST_FILES)
                        - {"test_deepep.py", COMPILE_TEST})
        parts.append(self._pytest("tests/gpu", [*files, *others], 150, reserve=130))
        failed = [p for p in parts if p.status != "passed"]
        summary = "\n\n".join(f"**{p.name}** ({p.status})\n```\n{p.summary}\n```" for p in parts)
        if not (self.rehearsal or deepep):
            summary = "test_deepep.py: not run (DeepEP is not installed)\n\n" + summary
        return Step("tests", failed[0].status if failed else "passed", sum(p.seconds for p in parts), summary,
                    "\n\n".join(tail(p.output, 30) for p in parts))

    def compiled(self) -> Step:
        """``--compile`` on CUDA: the proxy run compiled, then compile-equals-eager (tests/gpu)."""
        if self.args.quick:
            return Step("--compile", "skipped", summary="rehearsal --quick: no compiles (the full --rehearsal and "
                                                        "tests/training/test_compile.py compile on the CPU)")
        train = self.training(compile=True)
        test = self._pytest(COMPILE_TEST, [COMPILE_TEST], 90, reserve=40)
        parts = [train, test]
        failed = [p for p in parts if p.status != "passed"]
        summary = "\n\n".join(f"**{p.name}** ({p.status})\n```\n{p.summary}\n```" for p in parts)
        return Step("--compile", failed[0].status if failed else "passed", sum(p.seconds for p in parts), summary,
                    "\n\n".join(tail(p.output, 20) for p in parts))

    # installs, and what they make possible --------------------------------------------------------
    def install(self) -> Step:
        return gpu_install.install(self)

    def after_install(self) -> Step:
        newly = gpu_install.importable() - self.preinstalled
        if not newly:
            return Step("after install", "skipped", summary="nothing new became importable (optional packages: "
                                                            f"{', '.join(sorted(self.preinstalled)) or 'none'})")
        files, backends = rerun_plan(newly)
        parts = []
        if backends:
            parts.append(self.moe_layer(",".join(backends), f"MoE layer: {', '.join(backends)}", cap=80, reserve=40))
        files = [f for f in files if f != "test_deepep.py" or self.rehearsal]
        if "deep_ep" in newly and not self.rehearsal:   # DeepEP forks its ranks: a pytest process of its own
            if self.num_gpus >= 2:
                parts.append(self._pytest("test_deepep.py", ["test_deepep.py"], 120, reserve=20))
            else:
                parts.append(Step("test_deepep.py", "skipped", summary=f"needs >= 2 GPUs, {self.num_gpus} here"))
        if files:
            parts.append(self._pytest(f"tests/gpu: {' '.join(files)}", files, 120, reserve=20))
        failed = [p for p in parts if p.status not in ("passed", "skipped")]
        summary = f"newly importable: {', '.join(sorted(newly))}\n\n" + "\n\n".join(
            f"**{p.name}** ({p.status})\n```\n{p.summary}\n```" for p in parts)
        return Step("after install", failed[0].status if failed else "passed", sum(p.seconds for p in parts),
                    summary, "\n\n".join(tail(p.output, 20) for p in parts))

    def dispatch(self) -> Step:
        common = ["--dispatcher", "alltoall" + (",flex" if importlib.util.find_spec("deep_ep") is not None else "")]
        if self.rehearsal:  # spawned gloo ranks on the CPU, tiny sizes: the command line, not figures
            if self.args.quick:
                return Step("bench-dispatch (NCCL)", "skipped", summary="rehearsal --quick: not run")
            cmd = [self.python, "examples/bench_dispatch.py", *common, "--ep", "2", "--nprocs", "2", "--dtype", "bf16",
                   "--num-tokens", "16", "--hidden", "16", "--num-experts", "4", "--topk", "2", "--iters", "1",
                   "--warmup", "0"]
        elif self.num_gpus < 2:
            return Step("bench-dispatch (NCCL)", "skipped",
                        summary=f"needs >= 2 GPUs, this machine has {self.num_gpus}")
        else:
            n = min(self.num_gpus, 8)
            cmd = [self.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   "examples/bench_dispatch.py", *common, "--ep", str(n), "--dtype", "bf16", "--num-tokens", "8192",
                   "--hidden", "4096", "--num-experts", str(8 * n), "--topk", "8", "--iters", "10"]
        return self.cmd_step("bench-dispatch (NCCL)", cmd, 90, summarize=lambda t: tail(t, 12))

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


# in the order they run: first what needs nothing installed, then the installs and what they add
STEPS = ("api", "syncs", "train", "bench", "tests", "compile", "install", "after-install", "dispatch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m moefold.training.gpu.check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.md", help="the Markdown report (default gpu_check.md)")
    parser.add_argument("--log", default=None, help="all steps' output (default: the report's name with .log)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help=f"total seconds for every step (default {DEFAULT_BUDGET:.0f}; never past the deadline "
                             f"gpu_check.sh sets in $MOEFOLD_GPU_CHECK_DEADLINE)")
    parser.add_argument("--install-timeout", type=float, default=90.0, help="seconds per pip install (default 90)")
    parser.add_argument("--wheels", default=None,
                        help="a folder of .whl files (e.g. torchao) to install offline (--no-index --no-deps) into a "
                             "site folder on PYTHONPATH, after the steps that need nothing installed")
    parser.add_argument("--index-url", default=os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX),
                        help="the package index probed (4 s) before any install from it (default $PIP_INDEX_URL or "
                             "PyPI)")
    parser.add_argument("--deepep-src", default=None,
                        help="a DeepEP checkout to build (>= 2 GPUs): V2 (main; NCCL >= 2.30.4 from an nvidia-nccl "
                             "wheel, carried in --wheels if the machine's is older) or v1.2.1")
    parser.add_argument("--skip", default="", help=f"comma-separated steps to skip: {','.join(STEPS)}")
    parser.add_argument("--rehearsal", action="store_true",
                        help="run every step on the CPU with tiny sizes (no GPU needed): catches stale calls")
    parser.add_argument("--quick", action="store_true",
                        help="a CI-sized rehearsal (implies --rehearsal): tests/gpu's quick subset, no compiles")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(STEPS):
        parser.error(f"--skip {','.join(sorted(skip - set(STEPS)))}: valid steps are {', '.join(STEPS)}")
    check = Check(args)
    check.step(check.environment)
    if check.num_gpus == 0 and not check.rehearsal:
        check.steps.append(Step("GPU", "failed", summary="no CUDA device: nothing to check (--rehearsal runs every "
                                                         "step on the CPU)"))
        check.write()
        print(f"report: {check.out}")
        return 2
    plan = (("api", check.torch_api), ("syncs", check.syncs), ("train", check.training), ("bench", check.moe_layer),
            ("tests", check.tests), ("compile", check.compiled), ("install", check.install),
            ("after-install", check.after_install), ("dispatch", check.dispatch))
    try:
        for key, fn in plan:
            if key not in skip:
                check.step(fn)
                print(f"{check.steps[-1].name}: {check.steps[-1].status} ({check.steps[-1].seconds:.0f} s)", flush=True)
    finally:
        for folder in check.cleanup:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"report: {check.out}")
    return 0 if all(s.status in ("passed", "skipped") for s in check.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
