"""The GPU check's report of a carried ``nvidia-nccl`` wheel (``tools.gpu.install``), on the CPU.

A wheel installed into the check's site folder is what DeepEP V2 builds against; which ``libnccl`` torch maps
depends on its build (a pip-wheel torch loads the first ``nvidia/nccl`` on ``sys.path``), and DeepEP's import
refuses any other. The report names the file torch maps and the wheel's; when they differ, ``LD_PRELOAD`` of the
wheel's library is tried and kept for the later steps only when torch then maps that file alone. The wheel itself
is reported as a library, not imported as a module. Paths, versions and the subprocesses are stand-ins
(monkeypatched ``run``), as in test_check.py.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from moefold.tools.gpu import install as gpu_install


def _wheel_root(tmp_path: Path, content: bytes, name: str = "site") -> Path:
    root = tmp_path / name / "nvidia" / "nccl"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "libnccl.so.2").write_bytes(content)
    return root


def test_the_minimum_nccl_is_deepeps_in_both_places():
    from moefold.dispatch import deepep_nccl

    assert gpu_install.NCCL_MIN == deepep_nccl.NCCL_MIN == (2, 30, 4)


def test_the_file_torch_maps_is_reported_and_a_preload_kept_only_when_it_is_then_the_one(tmp_path):
    torch_lib = tmp_path / "env" / "libnccl.so.2"
    torch_lib.parent.mkdir()
    torch_lib.write_bytes(b"nccl 2.27.3")
    root = _wheel_root(tmp_path, b"nccl 2.30.4")
    lib = str(root / "lib" / "libnccl.so.2")
    line, preload = gpu_install.nccl_plan([str(torch_lib)], "2.27.3", "12.8", ("nvidia-nccl-cu12", "2.30.4", str(root)))
    assert preload == lib
    assert f"torch maps {torch_lib} (NCCL 2.27.3)" in line, line
    assert f"not the nvidia-nccl-cu12 2.30.4 DeepEP V2 links ({lib})" in line, line
    # the wheel's folder first on sys.path (torch's pip wheels load it), or after the upgrade: nothing to do
    line, preload = gpu_install.nccl_plan([lib], "2.30.4", "12.8", ("nvidia-nccl-cu12", "2.30.4", str(root)))
    assert preload is None and "the library DeepEP V2 links" in line, line
    # LD_PRELOAD: kept when torch then maps that one file (a torch that does not load NCCL itself) ...
    more, keep = gpu_install.preload_verdict([lib], lib, "nvidia-nccl-cu12")
    assert keep and f"under LD_PRELOAD={lib} torch maps that one only" in more, more
    # ... not when a pip-wheel torch maps its own as well (measured on torch 2.11.0+cu130): DeepEP refuses two
    more, keep = gpu_install.preload_verdict([str(torch_lib), lib], lib, "nvidia-nccl-cu12")
    assert not keep and "does not help" in more, more
    assert "pip install --no-deps --upgrade 'nvidia-nccl-cu12>=2.30.4' into torch's environment" in more, more


def test_the_wheel_is_the_first_on_sys_path_as_torch_and_deepep_take_it(tmp_path, monkeypatch):
    entries = []
    for folder, version in (("first", "2.30.4"), ("later", "2.31.2")):
        site = tmp_path / folder
        info = site / f"nvidia_nccl_cu12-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-cu12\nVersion: {version}\n")
        _wheel_root(tmp_path, b"nccl", name=folder)
        entries.append(str(site))
    monkeypatch.setattr(gpu_install.sys, "path", [*entries, *gpu_install.sys.path])
    assert gpu_install.nccl_wheel() == ("nvidia-nccl-cu12", "2.30.4", str(tmp_path / "first" / "nvidia" / "nccl"))


@pytest.mark.parametrize("wheel, cuda, says", [
    (("nvidia-nccl-cu13", "2.30.4"), "12.8", "not for this torch's CUDA 12.8: carry nvidia-nccl-cu12 >= 2.30.4"),
    (("nvidia-nccl-cu12", "2.30.4"), None, "torch maps no libnccl (a CPU build)"),
    (None, "12.8", "no nvidia-nccl wheel for DeepEP V2 to build against"),
])
def test_no_preload_where_it_cannot_help(tmp_path, wheel, cuda, says):
    root = _wheel_root(tmp_path, b"nccl")
    loaded = [str(tmp_path / "other" / "libnccl.so.2")] if cuda else []
    line, preload = gpu_install.nccl_plan(loaded, "2.27.3" if cuda else "", cuda,
                                          (*wheel, str(root)) if wheel else None)
    assert preload is None and says in line, line


def _check(tmp_path: Path, **args) -> types.SimpleNamespace:
    log = tmp_path / "check.log"
    log.write_text("")
    budget = types.SimpleNamespace(for_step=lambda cap, reserve=0: cap)
    return types.SimpleNamespace(args=types.SimpleNamespace(**args), rehearsal=False, num_gpus=2, env={},
                                 python="python", log=log, budget=budget, cleanup=[])


def test_a_carried_nccl_wheel_is_a_library_not_a_module(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("nvidia_nccl_cu12-2.30.4-py3-none-manylinux_2_18_x86_64.whl", "grouped_gemm-1.1.4-cp312-linux.whl"):
        (wheels / name).write_bytes(b"")
    commands = []

    def run(cmd, timeout, log, env=None):
        commands.append(cmd)
        if "--target" in cmd:   # pip: the nccl wheel's files land in the site folder
            _wheel_root(Path(cmd[cmd.index("--target") + 1]).parent, b"nccl",
                        name=Path(cmd[cmd.index("--target") + 1]).name)
        return 0, "1.1.4\n", 0.1

    monkeypatch.setattr(gpu_install, "run", run)
    monkeypatch.setattr(gpu_install.sys, "path", list(gpu_install.sys.path))
    lines, ok = gpu_install._wheels(_check(tmp_path, wheels=str(wheels)))
    imports = [c[-1] for c in commands if c[1] == "-c"]
    assert ok and len(imports) == 1 and imports[0].startswith("import grouped_gemm"), (imports, lines)
    assert any("nvidia_nccl_cu12: a library wheel, nvidia/nccl/lib/libnccl.so.2" in line and
               "torch keeps loading its own libnccl" in line for line in lines), lines
    line, found = gpu_install.library_wheel(tmp_path / "empty", "nvidia_nccl_cu12")
    assert not found and "FAILED: no shared library" in line


@pytest.mark.parametrize("under_preload, kept", [(["WHEEL"], True),
                                                 (["/env/nvidia/nccl/lib/libnccl.so.2", "WHEEL"], False)])
def test_deepep_v2_build_reports_nccl_and_imports_through_moefold(tmp_path, monkeypatch, under_preload, kept):
    """torch maps its own libnccl, not the wheel's: LD_PRELOAD of the wheel's is tried and kept for the later steps
    only when torch then maps that file alone; the import is moefold's (its one-line failure), in their
    environment."""
    src = tmp_path / "DeepEP"
    (src / "deep_ep" / "buffers").mkdir(parents=True)
    (src / "deep_ep" / "buffers" / "elastic.py").write_text("")
    root = _wheel_root(tmp_path, b"nccl 2.30.4")
    lib = str(root / "lib" / "libnccl.so.2")
    monkeypatch.setattr(gpu_install, "nccl_wheel", lambda: ("nvidia-nccl-cu12", "2.30.4", str(root)))
    monkeypatch.setattr(gpu_install.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda i=0: (9, 0))
    seen = []

    def run(cmd, timeout, log, env=None):
        env = dict(env or {})
        seen.append((cmd, env))
        if cmd[1:3] == ["-c", gpu_install.TORCH_NCCL_PROBE]:
            maps = [lib if f == "WHEEL" else f for f in under_preload] if "LD_PRELOAD" in env else \
                ["/env/nvidia/nccl/lib/libnccl.so.2"]
            return 0, repr((maps, "2.27.3", "12.8")) + "\n", 3.0
        if cmd[1] == "-c":   # the import, as the flex dispatcher imports it
            return 0, "2.1.0 ElasticBuffer\n", 5.0
        return 0, "built\n", 60.0

    monkeypatch.setattr(gpu_install, "run", run)
    check = _check(tmp_path, deepep_src=str(src))
    line, built = gpu_install._deepep(check)
    assert built is True and "import deep_ep: 2.1.0 ElasticBuffer" in line, line
    assert "torch maps /env/nvidia/nccl/lib/libnccl.so.2 (NCCL 2.27.3)" in line, line
    assert (check.env.get("LD_PRELOAD") == lib) == kept, (line, check.env)
    assert ("the later steps run with it" in line) == kept and ("does not help" in line) != kept, line
    probe, env = seen[-1]
    assert "import_deep_ep" in probe[-1] and (env.get("LD_PRELOAD") == lib) == kept
    check.num_gpus, check.env = 1, {}   # one GPU: not built, the NCCL line said all the same, nothing kept
    line, built = gpu_install._deepep(check)
    assert built is None and "not built (its kernels need >= 2 GPUs" in line and "LD_PRELOAD" not in check.env
    assert "torch maps /env/nvidia/nccl/lib/libnccl.so.2 (NCCL 2.27.3)" in line, line
