"""The GPU check's own machinery on CPU: it never hangs, always writes its report, and says why."""

from __future__ import annotations

import sys
import time

import torch

from moefold.training.gpu import check as gpu_check
from moefold.training.gpu import steps as gpu_check_steps


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
    assert files == ["test_fp8_cuda.py", "test_gemm_backends.py"] and backends == ["grouped_mm", "te"]
    assert gpu_check.rerun_plan(frozenset({"deep_ep"})) == (["test_deepep.py"], [])


def test_deepep_build_from_source_is_planned_per_version(tmp_path, monkeypatch):
    """--deepep-src: a V2 checkout builds against an nvidia-nccl wheel >= 2.30.4 (refused, naming the wheel to
    carry, when older or missing), a v1.2.1 one without; a rehearsal states the command instead of building."""
    import types

    from moefold.training.gpu import install as gpu_install

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
