"""The GPU check's own machinery on CPU: it never hangs, always writes its report, and says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from moefold.tools.gpu import check as gpu_check
from moefold.tools.gpu import steps as gpu_check_steps


def test_a_step_that_hangs_is_killed_with_its_children(tmp_path):
    log = tmp_path / "log"
    t0 = time.monotonic()
    # a child that starts a grandchild holding the output open: both must go
    rc, text, _ = gpu_check_steps.run(["sh", "-c", "echo started; sleep 60 & sleep 60"], 1.5, log)
    assert rc is None and "started" in text and time.monotonic() - t0 < 15
    assert "rc=None" in log.read_text()
    rc, text, _ = gpu_check_steps.run([sys.executable, "-c", "print('fine')"], 30, log)
    assert (rc, text.strip()) == (0, "fine")
    assert gpu_check_steps.run(["/nonexistent/tool"], 30, log)[0] == 127


def test_report_is_written_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        return  # the CPU-only path; on a GPU machine the check itself runs the real steps
    out = tmp_path / "report" / "check.md"
    assert gpu_check.main(["--out", str(out), "--budget", "60"]) == 2
    text = out.read_text()
    assert "# moefold GPU check" in text and "no CUDA device" in text and "| environment | passed |" in text
    assert (tmp_path / "report" / "check.log").exists()


def test_budget_leaves_room_for_later_steps():
    budget = gpu_check_steps.Budget(100)
    assert 89 < budget.for_step(cap=200, reserve=10) <= 90
    assert budget.for_step(cap=20) == 20
    assert budget.for_step(cap=50, reserve=150) == 0


def test_budget_scales_caps_and_reserves_and_stops_at_the_scripts_deadline():
    budget = gpu_check_steps.Budget(880, sized_for=440)
    assert 199 < budget.for_step(cap=100, reserve=10) <= 200   # twice the time for every step
    assert gpu_check.deadline_budget(440, None, now=1000.0) == 440
    assert gpu_check.deadline_budget(440, "1300", now=1000.0) == 285   # 15 s before gpu_check.sh's deadline


def test_installs_rerun_what_they_make_possible():
    assert gpu_check.rerun_plan(frozenset()) == ([], [])
    files, backends = gpu_check.rerun_plan(frozenset({"torchao", "transformer_engine"}))
    assert files == ["test_block_kernels_cuda.py", "test_fp8_cuda.py", "test_gemm_backends.py"]
    assert backends == ["grouped_mm", "te"]
    assert gpu_check.rerun_plan(frozenset({"deep_ep"})) == (["test_deepep.py"], [])


def test_deepep_build_from_source_is_planned_per_version(tmp_path, monkeypatch):
    """--deepep-src: a V2 checkout builds against an nvidia-nccl wheel >= 2.30.4 (refused, naming the wheel to
    carry, when older or missing), a v1.2.1 one without; a rehearsal states the command instead of building."""
    import types

    from moefold.tools.gpu import install as gpu_install

    v2, v1 = tmp_path / "DeepEP", tmp_path / "DeepEP-v1.2.1"
    (v2 / "deep_ep" / "buffers").mkdir(parents=True)
    (v2 / "deep_ep" / "buffers" / "elastic.py").write_text("")
    (v1 / "deep_ep").mkdir(parents=True)
    (v1 / "deep_ep" / "buffer.py").write_text("")
    assert [gpu_install.deepep_source(str(p)) for p in (v2, v1, tmp_path)] == ["V2", "v1", None]
    nccl = tmp_path / "site" / "nvidia" / "nccl"
    nccl.mkdir(parents=True)
    monkeypatch.setattr(gpu_install, "nccl_wheel", lambda: ("nvidia-nccl-cu12", "2.27.3", str(nccl)))
    cmd, _, why = gpu_install.deepep_build(str(v2), "V2", "9.0", {})
    assert cmd is None and "NCCL >= 2.30.4" in why and "nvidia-nccl-cu12 2.27.3" in why and "--wheels" in why
    monkeypatch.setattr(gpu_install, "nccl_wheel", lambda: ("nvidia-nccl-cu13", "2.30.4", str(nccl)))
    cmd, env, note = gpu_install.deepep_build(str(v2), "V2", "9.0", {})
    assert cmd[-4:] == ["install", "--no-build-isolation", "--no-deps", str(v2)] and "2.30.4" in note
    assert env["EP_NCCL_ROOT_DIR"] == str(nccl) and env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    cmd, env, _ = gpu_install.deepep_build(str(v1), "v1", "9.0", {})
    assert cmd is not None and "EP_NCCL_ROOT_DIR" not in env
    monkeypatch.setattr(gpu_install.importlib.util, "find_spec", lambda name: None)
    check = types.SimpleNamespace(args=types.SimpleNamespace(deepep_src=str(v2)), rehearsal=True, num_gpus=0,
                                  env={})
    line, built = gpu_install._deepep(check)
    assert built is None and "not built (rehearsal)" in line and f"EP_NCCL_ROOT_DIR={nccl}" in line, line


# ------------------------------------------------------------------------ issue 42, defect 4: verdicts the check keeps
def _check(tmp_path, *argv: str) -> gpu_check.Check:
    return gpu_check.Check(gpu_check.arg_parser().parse_args(["--out", str(tmp_path / "r.md"), *argv]))


def test_a_failed_table_row_fails_the_step_whatever_the_exit_code(tmp_path, monkeypatch):
    """A benchmark prints "failed: ..." in a row and exits 0 (the MoE-layer bench does, so the other rows still
    run): the step is failed. A row "skipped: ..." alone does not fail it."""
    out = {"text": ""}
    monkeypatch.setattr(gpu_check, "run", lambda cmd, timeout, log, env=None: (0, out["text"], 0.1))
    check = _check(tmp_path)
    out["text"] = ("| config | backend | layer ms |\n|---|---|---|\n| E8 | grouped_mm | 1.5 |\n"
                   "| E8 | te | skipped: no transformer_engine |\n")
    assert check.cmd_step("bench", ["bench"], "bench", summarize=gpu_check.table_rows).status == "passed"
    out["text"] += "| E8 | grouped_mm fp8 e4m3 rowwise | failed: RuntimeError: CUDA error |\n"
    step = check.cmd_step("bench", ["bench"], "bench", summarize=gpu_check.table_rows)
    assert step.status == "failed" and "1 row(s) failed" in step.summary and "$ bench" in step.summary
    out["text"] = "| model | result |\n|---|---|\n| qwen3_moe_tiny | failed: 3e-05 > 1.6e-05 |\n"
    assert check.cmd_step("parity", ["p"], "parity").status == "failed"


def test_a_step_of_parts_is_never_passed_over_a_failed_part():
    """tests, --compile and after install are parts (subprocesses): a skipped part first must not hide a failed one
    (the step used to take the first part that had not passed)."""
    def part(status: str) -> gpu_check_steps.Step:
        return gpu_check_steps.Step(status, status, 1.0, "")

    def combined(*statuses: str) -> str:
        return gpu_check_steps.parts_step("s", [part(s) for s in statuses]).status

    assert combined("skipped", "failed") == "failed"
    assert combined("passed", "timed out", "failed") == "failed"
    assert combined("timed out", "passed") == "timed out"
    assert combined("passed", "skipped") == "passed"
    assert combined("skipped", "skipped") == "skipped"


def test_pytest_keeps_every_finished_tests_name_when_cut(tmp_path):
    """tests/gpu runs with -v: each test is named when it starts and its outcome appended when it ends, so a run
    killed in its third test (here: it kills itself, as a timeout or a CUDA abort would) still names the passed and
    the failed test, and the test it was in; a failed test fails the step whatever the exit code."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    folder = tmp_path / "tests" / "gpu"
    folder.mkdir(parents=True)
    (folder / "test_cut.py").write_text(
        "import os, signal\n"
        "def test_a():\n    pass\n"
        "def test_b():\n    assert 1 == 2\n"
        "def test_c():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "def test_d():\n    pass\n")
    rc, text, _ = gpu_check_steps.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                                       "tests/gpu/test_cut.py"], 120, tmp_path / "log", cwd=tmp_path)
    assert rc not in (0, None), text
    results = gpu_check_steps.pytest_results(text)
    ids = "tests/gpu/test_cut.py::test_"
    assert results.outcomes == {ids + "a": "PASSED", ids + "b": "FAILED"}, text
    assert results.running == ids + "c"
    assert gpu_check_steps.pytest_status(0, text) == "failed"   # a failed test fails it even with exit code 0
    summary = gpu_check_steps.pytest_summary(text, None)   # as a timeout reports it
    assert f"FAILED {ids}b" in summary and f"running when the time cap hit: {ids}c" in summary, summary
    assert "1 passed, 1 failed" in summary


def test_a_non_finite_first_loss_is_reported_and_the_rows_go_on(tmp_path, monkeypatch, capsys):
    """The metrics log a non-finite loss as null: the row says so and fails, its figures still print, and the next
    row runs (the check used to format the first loss with :.3f and stop in its own code)."""
    from moefold.tools.gpu import train_rows

    def fake_train(argv: list[str]) -> int:
        run_dir = Path(argv[argv.index("--run-dir") + 1])
        run_dir.mkdir(parents=True)
        first = None if "qwen3_moe_tiny" in argv and "--optimizer-cpu-offload" not in argv else 6.2
        records = [{"kind": "run"}] + [
            {"kind": "step", "step": i + 1, "loss_lm": first if i == 0 else 6.1, "interval_s": 0.5,
             "tokens_per_s": None, "tflops_per_s": float("nan"), "mfu": None, "memory": {}} for i in range(3)]
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
        return 0

    monkeypatch.setattr(train_rows, "cli_main", fake_train)
    rc = train_rows.main(["--device", "cpu", "--size", "tiny", "--rows", "bf16,offload-optimizer", "--no-plan"])
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| bf16") or ln.startswith("| offl")]
    assert rc == 1 and len(rows) == 2, rows
    assert "non-finite -> 6.100" in rows[0] and "failed: non-finite loss at step 1" in rows[0], rows[0]
    assert "| n/a |" in rows[0] and rows[1].endswith("| passed |"), rows


def test_deepep_first_use_gets_its_own_budget_line(tmp_path, monkeypatch):
    """With DeepEP V2 and >= 2 GPUs the test that first uses it (and JIT-builds its kernels) runs alone, in its own
    pytest process with its own time (PLAN["deepep-jit"]), before DeepEP's tests and tests/gpu."""
    calls = []
    monkeypatch.setattr(gpu_check, "run", lambda cmd, timeout, log, env=None: calls.append((cmd, timeout))
                        or (0, "", 0.1))
    monkeypatch.setattr(gpu_check, "deepep_v2", lambda: True)
    real_find_spec = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name: object() if name == "deep_ep" else real_find_spec(name))
    check = _check(tmp_path, "--budget", "2000")
    check.num_gpus = 2
    step = check.tests()
    assert [c[0][-1] for c in calls[:2]] == [f"tests/gpu/{gpu_check.DEEPEP_JIT_TEST}", "tests/gpu/test_deepep.py"]
    assert all("-v" in cmd for cmd, _ in calls), "tests/gpu must run with -v: its names survive a cut (above)"
    assert calls[0][1] == gpu_check.PLAN["deepep-jit"][1] * check.budget.scale
    assert "DeepEP first use (JIT build)" in step.summary and step.status == "passed"


def test_deepep_jit_test_exists():
    """The test id the GPU check warms DeepEP's JIT with is one of tests/gpu/test_deepep.py's (collected in a
    rehearsal, where deep_ep is the CPU stand-in)."""
    env = {**os.environ, "MOEFOLD_GPU_REHEARSAL": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           f"tests/gpu/{gpu_check.DEEPEP_JIT_TEST}"], cwd=gpu_check_steps.REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert f"tests/gpu/{gpu_check.DEEPEP_JIT_TEST}" in proc.stdout, proc.stdout + proc.stderr


def test_budget_lines_reserve_the_floors_of_what_is_still_to_come(tmp_path):
    """A line keeps the floors of the later steps that run (not of skipped ones) and of its own step's later
    lines; DeepEP's lines, reached again from "after install", reserve only what comes after that step."""
    check = _check(tmp_path)
    floors = {k: v[2] for k, v in gpu_check.PLAN.items()}
    after_train = sum(floors[k] for k in ("bench", "graphs", "tests", "compile", "compile-test", "install", "fp8",
                                          "peers", "peers-step", "after-install", "dispatch"))
    assert check.limits("train") == (gpu_check.PLAN["train"][1], after_train)
    check.skip = frozenset({"tests", "compile"})
    assert check.limits("train")[1] == after_train - floors["tests"] - floors["compile"] - floors["compile-test"]
    check.skip = frozenset()
    check.current = "compile"
    assert check.limits("compile")[1] == floors["compile-test"] + floors["install"] + floors["fp8"] \
        + floors["peers"] + floors["peers-step"] + floors["after-install"]
    check.current = "after-install"
    assert check.limits("deepep-jit")[1] == floors["dispatch"] == 0
