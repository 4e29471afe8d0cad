"""One GPU check: what needs nothing installed first, installs after, one report written after every step.

    bash scripts/gpu_check.sh --out report.md [--wheels DIR]   # from the repository, nothing prepared
    python -m moefold.tools.gpu.check --out report.md        # where moefold is installed
    python -m moefold.tools.gpu.check --rehearsal --out r.md # every step on the CPU, tiny sizes

Sized for the machine a GPU check meets: a lent GPU with no package index at all, whose Python has torch,
triton, nvcc and the ``nvidia-nvshmem`` wheel, and no Transformer Engine, grouped_gemm, DeepEP or torchao.
Each step is a subprocess in its own process group with its own timeout inside one total budget (default
440 s, clamped to the deadline ``scripts/gpu_check.sh`` sets, so the whole check fits 8 minutes), in order:

1. environment: GPUs, driver, torch, CUDA, ``moefold env``;
2. torch API: every torch name moefold calls resolves in this machine's torch and takes moefold's keywords
   (``tools.gpu.torch_api``; the declared minimum is older than this machine's torch may be);
3. correct on CUDA: qwen3_moe, deepseek_v3 (MLA, MTP), qwen3_next, deepseek_v32 (DSA), nemotron_h (Mamba-2)
   and deepseek_v4 (compressed attention, mHC) tiny models, forward + backward in fp32 with
   TF32 off, equal the CPU's (logits, loss, every gradient), and a bf16 step's loss the fp32 one's
   (``tools.gpu.parity``: the tolerances derived there);
4. host syncs per MoE layer and per training step of the proxy model under CUDA's sync debug mode next to
   moefold's CPU model (``tools.gpu.bench syncs``);
5. proxy training (``tools.gpu.train_rows``): Qwen3-MoE's proxy in bf16, with activation offloading and with
   optimizer offloading beside it, and DeepSeek-V3's proxy with 2 layers: tokens/s, TFLOP/s, MFU, step time,
   the peak memory beside ``moefold plan``'s prediction for the same run;
6. the MoE layer in bf16 with ``grouped_mm`` against a dense bf16 matmul of the same FLOPs (``bench moe-layer``);
   (the peers, HF transformers and TorchTitan on the same card, come after it);
6b. CUDA graphs: training step time without graphs, with per-layer graphs (``--cuda-graph-impl local``, the whole
   layer and Megatron's MoE scopes) and with the whole step in one graph (``full_iteration``), the losses equal
   (``tools.gpu.graph_rows``: a small, launch-bound model; about 15 s);
7. ``pytest -v tests/gpu`` (tests of libraries that are not installed skip themselves; with DeepEP V2 on >= 2
   GPUs its first use, the JIT build of its kernels, runs first in a budget line of its own);
8. ``--compile`` on CUDA: the proxy run compiled and ``tests/gpu/test_compile_cuda.py``;
9. install: wheels carried in ``--wheels DIR`` (``pip --no-index --no-deps`` into a site folder on
   ``PYTHONPATH``; torch is never reinstalled), the ``.[gpu]`` parts from an index only if one answers within
   seconds, DeepEP from ``--deepep-src DIR`` with >= 2 GPUs (V2 against an nvidia-nccl wheel >= 2.30.4;
   ``tools.gpu.install``);
10. FP8 through torchao (carried): the proxy run with tensorwise and rowwise FP8 beside bf16, step time and loss;
11. after install: the tests and MoE-layer rows of whatever the installs made importable (DeepEP's tests in a
    pytest process of their own);
12. ``bench-dispatch`` over NCCL with >= 2 GPUs.

The plan of the budget (``PLAN``: cap and floor of each step's line, the H200's seconds) is in ``tools.gpu.plan``.

A step that fails, times out or cannot run is recorded with the reason and the check goes on; a step is failed,
never passed, when a row of its table failed or a test failed, whatever its exit code (``steps.failed_rows``,
``steps.pytest_status``); pytest runs with ``-v``, so a step its time cap cuts still names every finished test
and the one it cut. The Markdown report (``--out``) is rewritten after every step, with each step's command, so
it exists even if the check is killed, and the full output of every step goes to ``--log`` (default: next to the
report). Exit code: 0 when every step that ran passed, 1 otherwise; 2 without a CUDA device.

``--rehearsal`` runs every step on the CPU with tiny sizes (tests/gpu with ``MOEFOLD_GPU_REHEARSAL=1``:
see tests/gpu/rehearsal.py; the benchmarks with ``--device cpu``; installs from an index are not attempted,
carried wheels are), so that a stale call fails here rather than on the GPU machine's few minutes; ``--quick``
makes that a CI-sized run (tests/tools/gpu/test_rehearsal.py): tests/gpu's quick subset, no compiles, no
per-step caps (only the total budget: its verdict must not depend on a loaded CPU's seconds).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from moefold.tools.gpu import install as gpu_install
from moefold.tools.gpu.plan import (
    COMPILE_TEST,
    DEEPEP_JIT_TEST,
    DEFAULT_BUDGET,
    DEFAULT_INDEX,
    FP8_ROWS,
    PLAN,
    TEST_FILES,
    TRAIN_ROWS,
    deadline_budget,
    rerun_plan,
)
from moefold.tools.gpu.steps import (
    REPO,
    Budget,
    Step,
    failed_rows,
    parts_step,
    pytest_status,
    pytest_summary,
    run,
    status_of,
    table_rows,
    tail,
)


def deepep_v2() -> bool:
    """Is the importable ``deep_ep`` DeepEP 2.x (``deep_ep/buffers/elastic.py``: kernels JIT-built on first use)?"""
    spec = importlib.util.find_spec("deep_ep")
    return spec is not None and any((Path(p) / "buffers" / "elastic.py").is_file()
                                    for p in spec.submodule_search_locations or ())


class Check:
    def __init__(self, args: argparse.Namespace, skip: frozenset[str] = frozenset()) -> None:
        self.args = args
        self.skip = skip
        self.current = ""   # the step running (main sets it): budget lines are reserved from it on
        self.rehearsal = args.rehearsal or args.quick
        self.device = "cpu" if self.rehearsal else "cuda"
        self.out = Path(args.out).resolve()
        self.log = Path(args.log).resolve() if args.log else self.out.with_suffix(".log")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text(f"moefold GPU check, {dt.datetime.now(dt.timezone.utc).isoformat()}\n", encoding="utf-8")
        total = deadline_budget(args.budget, os.environ.get("MOEFOLD_GPU_CHECK_DEADLINE"), time.time())
        # --quick (CI): no per-step caps, only the total: its verdict counts the work, not a loaded CPU's seconds
        self.budget = Budget(total, sized_for=DEFAULT_BUDGET, capped=not args.quick)
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

    def limits(self, line: str) -> tuple[float, float]:
        """(cap, reserve) of a budget line: the reserve is the floors of the lines still to come: those of the
        steps after the one running (``self.current``) that will run, and this step's lines after ``line``."""
        order, keys = ("environment", *STEPS), list(PLAN)
        now = self.current if self.current in order else PLAN[line][0]

        def later(k: str) -> bool:
            step = PLAN[k][0]
            if step == now:
                return PLAN[line][0] == now and keys.index(k) > keys.index(line)
            return order.index(step) > order.index(now) and step not in self.skip

        return PLAN[line][1], sum(PLAN[k][2] for k in keys if later(k))

    def cmd_step(self, name: str, cmd: list[str], line: str, summarize: Callable[[str], str] = tail,
                 env: dict[str, str] | None = None, tests: bool = False) -> Step:
        """``cmd`` as one step within budget line ``line``. Its status: the exit code's, but failed when a table
        row it printed failed (``failed_rows``) or, for pytest (``tests``), when a test failed or errored; its
        summary starts with the command (every row's command stays in the report)."""
        cap, reserve = self.limits(line)
        timeout = self.budget.for_step(cap, reserve)
        if timeout < 5:
            return Step(name, "skipped", summary=f"not enough of the {self.budget.total:.0f} s budget left")
        rc, text, seconds = run(cmd, timeout, self.log, {**self.env, **(env or {})})
        if tests:
            status, summary = pytest_status(rc, text), pytest_summary(text, rc)
        else:
            status, summary = status_of(rc), summarize(text)
            bad = failed_rows(text)
            if bad and status == "passed":
                status, summary = "failed", f"{len(bad)} row(s) failed\n{summary}"
            if rc != 0:
                summary = (summary + "\n" + tail(text, 15)).strip()
        if rc is None:
            summary = f"timed out after {timeout:.0f} s\n{summary}"
        shown = " ".join(["python" if c == self.python else c for c in cmd])
        return Step(name, status, seconds, f"$ {shown}\n{summary}", tail(text))

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
        # a copied working tree can be ahead of the .git beside it (the lent machine's copy was): say so
        rc, status, _ = run(["git", "status", "--porcelain", "--untracked-files=no"], 10, self.log)
        changed = len(status.strip().splitlines()) if rc == 0 else None
        dirty = ("" if changed == 0 else f" with {changed} tracked files changed since it" if changed
                 else " (working tree state unknown)")
        optional = ", ".join(sorted(self.preinstalled)) or "none"
        self.header = ((f"- **rehearsal on the CPU** ({'quick, ' if self.args.quick else ''}tiny sizes): "
                        f"the code paths, not GPU figures\n" if self.rehearsal else "")
                       + f"- GPUs: {self.num_gpus} x {gpus[0] if gpus else 'none'} (compute capability {cap}); "
                       f"driver, memory: {driver or 'unknown'}\n"
                       f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}, "
                       f"{platform.machine()}, {os.cpu_count()} CPUs; optional packages at the start: {optional}\n"
                       f"- moefold commit {commit if re.fullmatch(r'[0-9a-f]{4,40}', commit) else 'unknown'}{dirty}; "
                       f"{os.environ.get('MOEFOLD_GPU_CHECK_INSTALL', 'run as python -m')}\n")
        return self.cmd_step("environment", [self.python, "-m", "moefold.training.cli", "env"], "environment")

    def torch_api(self) -> Step:
        return self.cmd_step("torch API", [self.python, "-m", "moefold.tools.gpu.torch_api"], "api",
                             summarize=lambda t: tail(t, 12))

    # measurements and tests (nothing installed) ---------------------------------------------------
    def parity(self) -> Step:
        return self.cmd_step("correct on CUDA", [self.python, "-m", "moefold.tools.gpu.parity", "--device",
                                                 self.device], "parity", summarize=lambda t: "\n".join(
            ln for ln in t.splitlines() if ln.startswith(("device", "|"))))

    def syncs(self) -> Step:
        size = [] if self.rehearsal else ["--train-recipe", "qwen3_moe_proxy", "--train-seq", "4096",
                                          "--train-vocab", "16384"]
        return self.cmd_step("host syncs", [self.python, "-m", "moefold.tools.gpu.bench", "syncs", "--device",
                                            self.device, *size], "syncs", summarize=table_rows)

    def _train_rows(self, name: str, line: str, rows: str, compile: bool = False) -> Step:
        """``tools.gpu.train_rows``: one ``moefold train`` run per row (proxy size; tiny in a rehearsal), no
        row started within 20 s (a proxy row's time) of the line's timeout."""
        cap, reserve = self.limits(line)
        timeout = self.budget.for_step(cap, reserve)
        cmd = [self.python, "-m", "moefold.tools.gpu.train_rows", "--device", self.device, "--size",
               "tiny" if self.rehearsal else "proxy", "--rows", rows, "--deadline", str(max(1, int(timeout - 20))),
               *(["--compile"] if compile else [])]
        return self.cmd_step(name, cmd, line, summarize=lambda t: "\n".join(
            ln for ln in t.splitlines() if ln.startswith(("|", "command ", "plan "))))

    def training(self) -> Step:
        """Proxy-size training steps: bf16, activation and optimizer offloading beside it, DeepSeek-V3's proxy;
        each with moefold plan's memory beside the measured peak."""
        return self._train_rows("proxy training", "train", TRAIN_ROWS)

    def moe_layer(self, backends: str = "grouped_mm", name: str = "MoE layer bf16 vs dense",
                  line: str = "bench") -> Step:
        cap, reserve = self.limits(line)
        timeout = self.budget.for_step(cap, reserve)
        cmd = [self.python, "-m", "moefold.tools.gpu.bench", "moe-layer", "--device", self.device,
               "--backends", backends, "--no-compile", "--deadline", str(max(1, int(timeout - 20)))]
        if self.rehearsal:
            cmd += ["--tokens", "64", "--configs", "8,2,32,64", "--iters", "1", "--warmup", "0", "--matmul-size", "64"]
        return self.cmd_step(name, cmd, line, summarize=lambda t: "\n".join(
            [ln for ln in t.splitlines() if ln.startswith(("device", "bf16 matmul"))] + [table_rows(t)]))

    def cuda_graphs(self) -> Step:
        """Step time without and with CUDA graphs (``tools.gpu.graph_rows``), no row started within 10 s of the
        line's timeout."""
        cap, reserve = self.limits("graphs")
        timeout = self.budget.for_step(cap, reserve)
        cmd = [self.python, "-m", "moefold.tools.gpu.graph_rows", "--device", self.device,
               "--deadline", str(max(1, int(timeout - 10)))]
        if self.rehearsal:
            cmd += ["--size", "tiny", "--warmup", "1", "--steps", "1"]
        return self.cmd_step("CUDA graphs", cmd, "graphs", summarize=lambda t: "\n".join(
            ln for ln in t.splitlines() if ln.startswith(("device", "(not CUDA", "|"))))

    def peers(self) -> Step:
        """The MoE layer and a proxy training step beside HF transformers and TorchTitan on the same card
        (``tools.gpu.peers``); after the installs, so that a carried TorchTitan wheel imports."""
        parts = []
        for what, line in (("layer", "peers"), ("step", "peers-step")):
            cap, reserve = self.limits(line)
            timeout = self.budget.for_step(cap, reserve)
            cmd = [self.python, "-m", "moefold.tools.gpu.peers", what, "--device", self.device,
                   "--deadline", str(max(1, int(timeout - 20)))]
            if self.rehearsal:
                cmd += ["--iters", "1", "--warmup", "0", *(["--seq", "16"] if what == "step" else [])]
            parts.append(self.cmd_step(f"peers {what}", cmd, line, summarize=lambda t: "\n".join(
                ln for ln in t.splitlines() if ln.startswith(("MoE layer", "training step", "|")))))
        return parts_step("peers (HF, TorchTitan)", parts)

    def _pytest(self, name: str, tests: list[str], line: str) -> Step:
        """pytest over ``tests`` (files or test ids under tests/gpu) with ``-v``: each test is named when it
        starts and its outcome appended when it ends, so a timeout keeps every finished test's name and outcome
        and names the one it cut (``steps.pytest_summary``)."""
        base = [self.python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfEs", "--durations=5"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            base += ["--timeout", "150"]
        return self.cmd_step(name, [*base, *(f"tests/gpu/{t}" for t in tests)], line, tests=True)

    def _deepep_tests(self) -> list[Step]:
        """DeepEP's tests in a pytest process of their own (its ranks fork: a parent that has not initialised
        CUDA). With DeepEP V2 and >= 2 GPUs its first use JIT-builds kernels (minutes, cached in
        ``$EP_JIT_CACHE_DIR``): that test runs alone first, in its own budget line, so the build takes neither
        the tests' time nor their names with it."""
        parts = []
        if self.num_gpus >= 2 and deepep_v2():
            parts.append(self._pytest("DeepEP first use (JIT build)", [DEEPEP_JIT_TEST], "deepep-jit"))
        parts.append(self._pytest("test_deepep.py", ["test_deepep.py"], "deepep-tests"))
        return parts

    def tests(self) -> Step:
        deepep = importlib.util.find_spec("deep_ep") is not None
        parts = self._deepep_tests() if deepep and not self.rehearsal else []
        # a rehearsal initialises no CUDA: DeepEP's test (its CPU stand-in) runs in the same process
        files = [*TEST_FILES, *(["test_deepep.py"] if self.rehearsal else [])]
        others = sorted({p.name for p in (REPO / "tests" / "gpu").glob("test_*.py")} - set(TEST_FILES)
                        - {"test_deepep.py", COMPILE_TEST})
        parts.append(self._pytest("tests/gpu", [*files, *others], "tests"))
        note = "" if self.rehearsal or deepep else "test_deepep.py: not run (DeepEP is not installed)\n\n"
        return parts_step("tests", parts, note)

    def compiled(self) -> Step:
        """``--compile`` on CUDA: the proxy run compiled, then compile-equals-eager (tests/gpu)."""
        if self.args.quick:
            return Step("--compile", "skipped", summary="rehearsal --quick: no compiles (the full --rehearsal and "
                                                        "tests/execution/test_compile.py compile on the CPU)")
        train = self._train_rows("proxy training --compile", "compile", "bf16", compile=True)
        return parts_step("--compile", [train, self._pytest(COMPILE_TEST, [COMPILE_TEST], "compile-test")], lines=20)

    # installs, and what they make possible --------------------------------------------------------
    def install(self) -> Step:
        return gpu_install.install(self)

    def fp8(self) -> Step:
        """FP8 training through torchao (tensorwise, rowwise) beside bf16: step time and loss. torchao is carried
        to the GPU machine as a wheel, so this runs after the installs."""
        if "torchao" not in gpu_install.importable():
            return Step("FP8 (torchao)", "skipped", summary="torchao is not importable: carry its wheel in --wheels "
                                                            "(docs/gpus.md: torchao 0.18.0 for torch 2.11)")
        return self._train_rows("FP8 (torchao)", "fp8", FP8_ROWS)

    def after_install(self) -> Step:
        newly = gpu_install.importable() - self.preinstalled
        if not newly:
            return Step("after install", "skipped", summary="nothing new became importable (optional packages: "
                                                            f"{', '.join(sorted(self.preinstalled)) or 'none'})")
        files, backends = rerun_plan(newly)
        parts = []
        if backends:
            parts.append(self.moe_layer(",".join(backends), f"MoE layer: {', '.join(backends)}", "after-install"))
        files = [f for f in files if f != "test_deepep.py" or self.rehearsal]
        if "deep_ep" in newly and not self.rehearsal:   # DeepEP forks its ranks: a pytest process of its own
            parts += self._deepep_tests()
        if files:
            parts.append(self._pytest(f"tests/gpu: {' '.join(files)}", files, "after-install"))
        return parts_step("after install", parts, f"newly importable: {', '.join(sorted(newly))}\n\n", lines=20)

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
        return self.cmd_step("bench-dispatch (NCCL)", cmd, "dispatch", summarize=lambda t: tail(t, 12))

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
STEPS = ("api", "parity", "syncs", "train", "bench", "graphs", "tests", "compile", "install", "fp8", "peers",
         "after-install", "dispatch")


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m moefold.tools.gpu.check", description=__doc__.split("\n")[0])
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
                        help="a CI-sized rehearsal (implies --rehearsal): tests/gpu's quick subset, no compiles, no "
                             "per-step caps")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser()
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(STEPS):
        parser.error(f"--skip {','.join(sorted(skip - set(STEPS)))}: valid steps are {', '.join(STEPS)}")
    check = Check(args, frozenset(skip))
    check.step(check.environment)
    if check.num_gpus == 0 and not check.rehearsal:
        check.steps.append(Step("GPU", "failed", summary="no CUDA device: nothing to check (--rehearsal runs every "
                                                         "step on the CPU)"))
        check.write()
        print(f"report: {check.out}")
        return 2
    plan = (("api", check.torch_api), ("parity", check.parity), ("syncs", check.syncs), ("train", check.training),
            ("bench", check.moe_layer), ("graphs", check.cuda_graphs), ("tests", check.tests),
            ("compile", check.compiled), ("install", check.install),
            ("fp8", check.fp8), ("peers", check.peers), ("after-install", check.after_install),
            ("dispatch", check.dispatch))
    try:
        for key, fn in plan:
            if key not in skip:
                check.current = key
                check.step(fn)
                print(f"{check.steps[-1].name}: {check.steps[-1].status} ({check.steps[-1].seconds:.0f} s)", flush=True)
    finally:
        for folder in check.cleanup:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"report: {check.out}")
    return 0 if all(s.status in ("passed", "skipped") for s in check.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
