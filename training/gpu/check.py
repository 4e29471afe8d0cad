"""One GPU check: install what can be installed, run the GPU benchmarks and tests/gpu, write one report.

    bash scripts/gpu_check.sh --out report.md [--wheels .whl]    # from the repository, nothing prepared
    python -m moefold.training.gpu.check --out report.md          # where moefold is installed
    python -m moefold.training.gpu.check --rehearsal --out r.md   # every step on the CPU, tiny sizes

On a machine with NVIDIA GPU(s) it runs, in order (cheapest and most telling first), each step a
subprocess in its own process group with its own timeout inside one total budget (default 440 s,
so that the whole check fits 8 minutes on one GPU):

1. environment: GPUs, driver, torch, CUDA, ``moefold env``;
2. install: wheels carried in ``--wheels DIR`` (``pip install --no-index --no-deps --target``, put on
   ``PYTHONPATH`` for every later step; a machine without network can only get packages this way);
   then the ``.[gpu]`` parts that are missing from the package index, only if the index answers
   within seconds (a machine without network says so in the report and loses no time); DeepEP from
   ``--deepep-src DIR`` with >= 2 GPUs;
3. host syncs per MoE layer and per training step under CUDA's sync debug mode next to moefold's
   CPU model;
4. a proxy-recipe training run (tokens/s, TFLOP/s, MFU from its metrics);
5. the MoE layer in bf16 per GEMM backend (and FP8, compiled) against a dense bf16 matmul of the
   same FLOPs;
6. ``bench-dispatch`` over NCCL with >= 2 GPUs;
7. ``pytest tests/gpu`` (DeepEP's multi-GPU test in a pytest process of its own, when DeepEP is there).

A step that fails, times out or cannot run is recorded with the reason and the check goes on;
the Markdown report (``--out``) is rewritten after every step, so it exists even if the check is
killed, and the full output of every step goes to ``--log`` (default: next to the report).
Exit code: 0 when every step that ran passed, 1 otherwise; 2 without a CUDA device.

``--rehearsal`` runs every step on the CPU with tiny sizes (tests/gpu with ``MOEFOLD_GPU_REHEARSAL=1``:
see tests/gpu/rehearsal.py; the benchmarks with ``--device cpu``; installs from the index are not
attempted, carried wheels are), so that a stale call fails here rather than on the GPU machine's
few minutes; ``--quick`` makes that a CI-sized run (tests/training/gpu/test_rehearsal.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
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

GPU_PARTS = (("transformer_engine", "transformer-engine[pytorch]"), ("grouped_gemm", "grouped-gemm"))
DEFAULT_INDEX = "https://pypi.org/simple/"
DEFAULT_BUDGET = 440.0  # seconds: the steps' reserves are sized for it
# tests/gpu in the order they run: quick and telling first, the compile test (Triton compiles) last
TEST_FILES = ("test_device_agnostic.py", "test_host_sync_cuda.py", "test_gemm_backends.py", "test_fp8_cuda.py",
              "test_cp_attention.py", "test_attention_sinks_cuda.py", "test_from_hf_cuda.py", "test_compile_cuda.py")


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rehearsal = args.rehearsal or args.quick
        self.device = "cpu" if self.rehearsal else "cuda"
        self.out = Path(args.out).resolve()
        self.log = Path(args.log).resolve() if args.log else self.out.with_suffix(".log")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text(f"moefold GPU check, {dt.datetime.now(dt.timezone.utc).isoformat()}\n", encoding="utf-8")
        self.budget = Budget(args.budget, sized_for=DEFAULT_BUDGET)
        self.steps: list[Step] = []
        self.header = ""
        self.python = sys.executable
        self.num_gpus = 0
        self.env: dict[str, str] = {}  # for every step's subprocess: PYTHONPATH with the carried wheels
        self.cleanup: list[Path] = []  # folders removed when the check ends
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
        self.header = ((f"- **rehearsal on the CPU** ({'quick, ' if self.args.quick else ''}tiny sizes): "
                        f"the code paths, not GPU figures\n" if self.rehearsal else "")
                       + f"- GPUs: {self.num_gpus} x {gpus[0] if gpus else 'none'} (compute capability {cap}); "
                       f"driver, memory: {driver or 'unknown'}\n"
                       f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}, "
                       f"{platform.machine()}, {os.cpu_count()} CPUs\n"
                       f"- moefold commit {commit if re.fullmatch(r'[0-9a-f]{4,40}', commit) else 'unknown'}; "
                       f"{os.environ.get('MOEFOLD_GPU_CHECK_INSTALL', 'run as python -m')}\n")
        return self.cmd_step("environment", [self.python, "-m", "moefold.training.cli", "env"], 60)

    # install ---------------------------------------------------------------------------------
    def _wheels(self) -> tuple[list[str], bool]:
        """Install the carried wheels into a site folder put on PYTHONPATH; (report lines, ok)."""
        folder = Path(self.args.wheels)
        wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
        if not wheels:
            return [f"- wheels: no .whl in {folder}"], False
        site = Path(tempfile.mkdtemp(prefix="moefold-gpu-check-site-"))
        self.cleanup.append(site)
        rc, text, seconds = run([self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                 "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(site),
                                 *map(str, wheels)], self.budget.for_step(90, 300), self.log)
        names = ", ".join(w.name for w in wheels)
        if rc != 0:
            return [f"- wheels {names}: pip {status_of(rc)} in {seconds:.0f} s: {tail(text, 2)[:300]}"], False
        path = os.environ.get("PYTHONPATH", "")
        self.env["PYTHONPATH"] = f"{site}{os.pathsep}{path}" if path else str(site)
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
        lines, ok = [f"- wheels installed into {site} (on PYTHONPATH for every step) in {seconds:.0f} s: {names}"], True
        for wheel in wheels:  # each distribution must import with this machine's torch
            module = wheel.name.split("-")[0].lower()
            rc, text, _ = run([self.python, "-c", f"import {module}; print(getattr({module}, '__version__', ''))"],
                              60, self.log, self.env)
            ok = ok and rc == 0
            lines.append(f"  - import {module}: " + (f"ok {text.strip().splitlines()[-1] if text.strip() else ''}"
                                                     if rc == 0 else f"FAILED: {tail(text, 1)[:300]}"))
        return lines, ok

    def _index_reachable(self) -> tuple[bool, str]:
        """Does the package index answer within seconds? (a subprocess: name resolution has no timeout)"""
        url = self.args.index_url
        probe = ("import sys, urllib.request\n"
                 "urllib.request.urlopen(urllib.request.Request(sys.argv[1], method='HEAD'), timeout=4)\n")
        rc, text, seconds = run([self.python, "-c", probe, url], 8, self.log)
        if rc == 0:
            return True, f"package index {url} answered in {seconds:.1f} s"
        why = "no answer" if rc is None else (tail(text, 1).split(":")[-1].strip() or "error")
        return False, f"package index {url} unreachable ({why}, {seconds:.1f} s): no network"

    def install(self) -> Step:
        lines: list[str] = []
        ok, attempted = True, False
        if self.args.wheels:
            wheel_lines, ok = self._wheels()
            lines += wheel_lines
            attempted = True
        missing = [(module, spec) for module, spec in GPU_PARTS if importlib.util.find_spec(module) is None]
        lines += [f"- {spec}: already installed" for module, spec in GPU_PARTS if (module, spec) not in missing]
        if missing:
            reachable, why = self._index_reachable()
            names = ", ".join(spec for _, spec in missing)
            if not reachable:
                lines.append(f"- {why}: not installed: {names} (their tests and rows are skipped; "
                             f"carry wheels with --wheels DIR)")
            elif self.rehearsal:
                lines.append(f"- {why}; rehearsal: would install {names} from it (not attempted)")
            else:
                attempted = True
                for _module, spec in missing:
                    cmd = [self.python, "-m", "pip", "install", "--no-build-isolation", "--retries", "0", "--timeout",
                           "10", "--index-url", self.args.index_url, spec]
                    rc, text, seconds = run(cmd, self.budget.for_step(self.args.install_timeout, 300), self.log,
                                            {**self.env, "MAX_JOBS": str(os.cpu_count() or 4)})
                    ok = ok and rc == 0
                    reason = "" if rc == 0 else ": " + (tail(text, 1) or "no output")[:200]
                    lines.append(f"- {spec}: {status_of(rc)} in {seconds:.0f} s{reason}")
        line, built = self._deepep()
        lines.append(line)
        if built is not None:
            attempted, ok = True, ok and built
        status = ("passed" if ok else "failed") if attempted else "skipped"
        return Step("install", status, summary="\n".join(lines))

    def _deepep(self) -> tuple[str, bool | None]:
        """(report line, whether a build from --deepep-src passed; None when none was tried)."""
        if importlib.util.find_spec("deep_ep") is not None:
            return "- DeepEP: already installed", None
        if not self.args.deepep_src:
            return "- DeepEP: not installed (not on PyPI: pass --deepep-src DIR, a DeepEP v1.2.1 checkout)", None
        if self.num_gpus < 2 or self.rehearsal:
            return f"- DeepEP: not built (its kernels need >= 2 GPUs; this machine has {self.num_gpus})", None
        import torch

        major, minor = torch.cuda.get_device_capability(0)
        rc, text, seconds = run([self.python, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                                 self.args.deepep_src], self.budget.for_step(240, 300), self.log,
                                {**self.env, "TORCH_CUDA_ARCH_LIST": f"{major}.{minor}"})
        return (f"- DeepEP from {self.args.deepep_src}: {status_of(rc)} in {seconds:.0f} s"
                + ("" if rc == 0 else ": " + tail(text, 1)[:200])), rc == 0

    # measurements and tests -------------------------------------------------------------------
    def syncs(self) -> Step:
        return self.cmd_step("host syncs", [self.python, "-m", "moefold.training.gpu.bench", "syncs", "--device",
                                            self.device], 90, reserve=330, summarize=table_rows)

    def training(self) -> Step:
        run_dir = Path(tempfile.mkdtemp(prefix="moefold-gpu-check-"))
        if self.rehearsal:
            recipe, sizes = "qwen3_moe_tiny", ["--train-iters", "3", "--micro-batch-size", "1", "--global-batch-size",
                                               "2", "--seq-length", "32", "--vocab-size", "512"]
        else:
            recipe, sizes = "qwen3_moe_proxy", ["--train-iters", "8", "--micro-batch-size", "1", "--global-batch-size",
                                                "8", "--seq-length", "4096", "--vocab-size", "16384"]
        cmd = [self.python, "-m", "moefold.training.cli", "train", "--recipe", recipe, "--device", self.device,
               "--bf16", *sizes, "--log-interval", "1", "--lr-warmup-iters", "2", "--no-save", "--no-balance-report",
               "--run-dir", str(run_dir)]
        step = self.cmd_step("proxy training", cmd, 150, reserve=270)
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
            tokens = last[-1].get("tokens")
            step.summary = (f"{recipe} bf16, {tokens} tokens per step, world 1; mean of steps "
                            f"{last[0]['step']}-{last[-1]['step']}: {fmt(tps, '.0f')} tokens/s, "
                            f"{fmt(tflops, '.3g')} TFLOP/s, MFU {fmt(mfu, '.3f')}; max allocated "
                            f"{fmt(mem.get('max_allocated_gib'), '.1f')} GiB; "
                            f"loss {records[0]['loss_lm']:.3f} -> {records[-1]['loss_lm']:.3f}\n") + last_lines(
                                step.output, ("step ", "done:", "model:", "rank 0 memory"))
        elif step.status == "passed":
            step.status, step.summary = "failed", f"no step records in {metrics.name}\n{step.summary}"
        return step

    def moe_layer(self) -> Step:
        timeout = self.budget.for_step(150, 160)
        cmd = [self.python, "-m", "moefold.training.gpu.bench", "moe-layer", "--device", self.device,
               "--deadline", str(max(1, int(timeout - 30)))]
        if self.rehearsal:
            cmd += ["--tokens", "64", "--configs", "8,2,32,64", "--iters", "1", "--warmup", "0", "--matmul-size", "64"]
        if self.args.quick:
            cmd += ["--no-compile"]
        return self.cmd_step("MoE layer bf16 vs dense", cmd, 150, reserve=160, summarize=lambda t: "\n".join(
            [ln for ln in t.splitlines() if ln.startswith(("device", "bf16 matmul"))] + [table_rows(t)]))

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
        return self.cmd_step("bench-dispatch (NCCL)", cmd, 90, reserve=120, summarize=lambda t: tail(t, 12))

    def tests(self) -> Step:
        base = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--durations=5"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            base += ["--timeout", "150"]
        parts: list[Step] = []
        deepep = importlib.util.find_spec("deep_ep") is not None
        if deepep and not self.rehearsal:
            # DeepEP forks its ranks: a pytest process that has not initialised CUDA
            parts.append(self.cmd_step("test_deepep.py", [*base, "tests/gpu/test_deepep.py"], 150, reserve=120,
                                       summarize=pytest_summary))
        # a rehearsal initialises no CUDA: DeepEP's test (its CPU stand-in) runs in the same process
        files = [f"tests/gpu/{name}" for name in TEST_FILES] + (["tests/gpu/test_deepep.py"] if self.rehearsal else [])
        others = sorted({p.name for p in (REPO / "tests" / "gpu").glob("test_*.py")} - set(TEST_FILES)
                        - {"test_deepep.py"})
        parts.append(self.cmd_step("tests/gpu", [*base, *files, *(f"tests/gpu/{name}" for name in others)], 400,
                                   summarize=pytest_summary))
        failed = [p for p in parts if p.status != "passed"]
        status = failed[0].status if failed else "passed"
        summary = "\n\n".join(f"**{p.name}** ({p.status})\n```\n{p.summary}\n```" for p in parts)
        if not (self.rehearsal or deepep):
            summary = "test_deepep.py: not run (DeepEP is not installed)\n\n" + summary
        return Step("tests", status, sum(p.seconds for p in parts), summary,
                    "\n\n".join(tail(p.output, 30) for p in parts))

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


STEPS = ("install", "syncs", "train", "bench", "dispatch", "tests")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moefold.training.gpu.check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.md", help="the Markdown report (default gpu_check.md)")
    parser.add_argument("--log", default=None, help="all steps' output (default: the report's name with .log)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help=f"total seconds for every step (default {DEFAULT_BUDGET:.0f})")
    parser.add_argument("--install-timeout", type=float, default=90.0, help="seconds per pip install (default 90)")
    parser.add_argument("--wheels", default=None,
                        help="a folder of .whl files (e.g. torchao) to install offline (--no-index --no-deps) into a "
                             "site folder on PYTHONPATH before anything else")
    parser.add_argument("--index-url", default=os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX),
                        help="the package index probed (4 s) before any install from it (default $PIP_INDEX_URL or "
                             "PyPI)")
    parser.add_argument("--deepep-src", default=None, help="a DeepEP v1.2.1 checkout to build (>= 2 GPUs)")
    parser.add_argument("--skip", default="", help=f"comma-separated steps to skip: {','.join(STEPS)}")
    parser.add_argument("--rehearsal", action="store_true",
                        help="run every step on the CPU with tiny sizes (no GPU needed): catches stale calls")
    parser.add_argument("--quick", action="store_true",
                        help="a CI-sized rehearsal (implies --rehearsal): tests/gpu's quick subset, no compile")
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
    plan = (("install", check.install), ("syncs", check.syncs), ("train", check.training), ("bench", check.moe_layer),
            ("dispatch", check.dispatch), ("tests", check.tests))
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
