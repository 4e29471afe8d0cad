"""The GPU check's budget plan: the steps' time lines, the tests and rows each step runs, and what an install
adds.

The plan on the lent H200 (``PLAN``: cap and floor of each budget line; in brackets the seconds of the one H200 run
so far, 2026-12-04, which skipped the MoE layer, --compile and after-install): a line gets min(cap, what is left
after the floors of the later lines), so the check ends in time whatever a step takes, and a step squeezed out says
so.

| step | expected s | cap s | floor s |
|---|---|---|---|
| environment | 8 (H200: 8) | 45 | 0 |
| torch API | 8 (9) | 20 | 10 |
| correct on CUDA (3 tiny models, CPU and GPU) | 15 (13) | 45 | 20 |
| host syncs (5 layer rows, one proxy step) | 20 (16) | 40 | 15 |
| proxy training (4 runs of 5-6 steps, the planner after each) | 70 (53) | 100 | 40 |
| MoE layer | 40 | 60 | 20 |
| CUDA graphs (5 rows of 9 small steps) | 15 | 30 | 10 |
| tests/gpu | 90 (21) | 100 | 40 |
| --compile (proxy run of 4 steps 70, compile test 25) | 95 | 90 + 40 | 30 + 10 |
| install (torchao's wheel) | 8 (27, five wheels) | 20 | 5 |
| FP8 (3 runs of 6 steps) | 40 (38) | 50 | 20 |
| peers (layer and step, after the installs) | 45 (33) | 60 + 50 | 15 + 10 |
| after install (FP8 tests and layer rows) | 45 | 60 | 15 |
| **total** | 499 estimated, **413** with the H200's seconds where measured, of 440 | | |
| with DeepEP V2 and >= 2 GPUs: its JIT build, its tests, bench-dispatch | | 180, 120, 90 | 0 |
"""

from __future__ import annotations

DEFAULT_BUDGET = 440.0  # seconds: the plan's caps and floors are sized for it
DEFAULT_INDEX = "https://pypi.org/simple/"
# The budget's lines in the order they run: (step key, cap s, floor s). A line gets min(cap, what is left after the
# floors of the later lines whose steps run); caps and floors are the H200 plan of the module docstring.
PLAN: dict[str, tuple[str, float, float]] = {
    "environment": ("environment", 45, 0), "api": ("api", 20, 10), "parity": ("parity", 45, 20),
    "syncs": ("syncs", 40, 15), "train": ("train", 100, 40), "bench": ("bench", 60, 20),
    "graphs": ("graphs", 30, 10),
    "deepep-jit": ("tests", 180, 0), "deepep-tests": ("tests", 120, 0), "tests": ("tests", 100, 40),
    "compile": ("compile", 90, 30), "compile-test": ("compile", 40, 10), "install": ("install", 20, 5),
    "fp8": ("fp8", 50, 20), "peers": ("peers", 60, 15), "peers-step": ("peers", 50, 10),
    "after-install": ("after-install", 60, 15), "dispatch": ("dispatch", 90, 0),
}
# tests/gpu in the order they run: quick and telling first; the compile test runs in the compile step
TEST_FILES = ("test_device_agnostic.py", "test_host_sync_cuda.py", "test_gemm_backends.py", "test_fp8_cuda.py",
              "test_cp_attention.py", "test_attention_sinks_cuda.py", "test_from_hf_cuda.py")
COMPILE_TEST = "test_compile_cuda.py"
# DeepEP V2's first use JIT-builds its kernels (minutes): this test, alone and first, with its own budget line
# (tests/tools/gpu/test_check.py checks that it exists)
DEEPEP_JIT_TEST = "test_deepep.py::test_flex_matches_alltoall[deepep-dropless-False-1]"
# the tests and MoE-layer backends that an optional package, once importable, adds to what already ran
RERUN_TESTS = {"torchao": ("test_fp8_cuda.py", "test_block_kernels_cuda.py"),
               "transformer_engine": ("test_gemm_backends.py", "test_fp8_cuda.py"),
               "grouped_gemm": ("test_gemm_backends.py",), "deep_ep": ("test_deepep.py",)}
RERUN_BACKENDS = {"transformer_engine": "te", "grouped_gemm": "grouped_gemm", "torchao": "grouped_mm"}
# the longest row first: the deadline then skips a short one, if any
TRAIN_ROWS = "deepseek-v3,bf16,offload-activations,offload-optimizer"
FP8_ROWS = "bf16,fp8-tensorwise,fp8-rowwise"


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
