"""The wheel installs one top-level package, ``moefold``, that works from any working directory.

Builds the wheel, installs it into a fresh virtual environment that sees this interpreter's
packages (so the CPU torch is reused and nothing is downloaded), and runs moefold from a directory
holding a user's own ``models/`` and ``training/`` packages, which must not shadow moefold's.

"This interpreter's packages" are its site-packages directories, whichever interpreter runs the tests:
CI's plain one, or a user's virtual environment where torch lives (``venv``'s ``system_site_packages``
would see the *base* interpreter behind that venv instead). They are listed in a ``.pth`` file as plain
paths, so their own ``.pth`` files (an editable moefold among them) are not run and the wheel's copy of
moefold is the only one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds wheels itself from 70.1 on (before, only with the `wheel` package); the test extra pins
    # one, while a venv's own setuptools (what `python -m venv` seeds) may be older
    major, minor = (int(p) for p in version("setuptools").split(".")[:2])
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        pytest.fail(f"building the wheel needs setuptools>=70.1 (this interpreter has {version('setuptools')}): "
                    "pip install -e '.[test]'")
    # from a copy without the checkout's build outputs: setuptools reuses a stale build/lib, whose packages would
    # reach the wheel even after setup.py stopped listing them (a folder dropped from FOLDERS still "passed")
    src = tmp_path_factory.mktemp("source") / "moefold"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".git",
                                                             "runs", ".whl", ".gl", ".pytest_cache", ".ruff_cache"))
    # no build isolation: setuptools is already here, and CI must not depend on the index for it
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out),
          str(src)], cwd=src, env=dict(os.environ))
    (whl,) = out.glob("moefold-*.whl")
    return whl


def test_wheel_has_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"moefold"}, sorted(tops)
    for package in ("parallel", "precision", "dense", "moe", "dispatch", "pipeline", "models", "models/hf", "training",
                    "training/data", "planner", "tools", "tools/gpu"):
        assert f"moefold/{package}/__init__.py" in names
    assert not any(n.startswith("moefold/tests/") for n in names)


def _site_dirs() -> list[str]:
    """The site-packages directories of the interpreter running the tests, in its own order."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def _venv_seeing_these_packages(env_dir: Path) -> Path:
    """A fresh venv whose interpreter also imports this interpreter's packages (after its own); its python."""
    venv.EnvBuilder(system_site_packages=False, with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    Path(own, "_moefold_test_parent_site.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    return python


@pytest.mark.slow   # a fresh venv and a pip install: `python -m pytest -q -m slow` (.ci/run) runs it
def test_installed_wheel_runs_beside_a_users_own_packages(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    python = _venv_seeing_these_packages(env_dir)
    moefold = env_dir / "bin" / "moefold"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    import torch

    # the packages of the interpreter running the tests (torch in a user's venv), seen from the new venv
    torch_there = _run([str(python), "-c", "import torch; print(torch.__file__)"], cwd=tmp_path, env=env)
    assert torch_there.strip() == torch.__file__
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path, env=env)

    work = tmp_path / "project"  # a user's project with packages named like moefold's folders
    for name in ("models", "training"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text("raise ImportError('the user project shadowed moefold')\n")

    assert "moefold: 0.1.0" in _run([str(moefold), "env"], cwd=work, env=env)
    where = _run([str(python), "-c", "import moefold.moe, moefold.training; print(moefold.moe.__file__)"],
                 cwd=work, env=env)
    assert where.strip().startswith(str(env_dir)), where  # the wheel's copy, not the checkout
    out = _run([str(moefold), "train", "--recipe", "qwen3_moe_tiny", "--train-iters", "5", "--log-interval", "1",
                "--run-dir", "runs/wheel"], cwd=work, env=env, timeout=600)
    assert "done: 5 steps" in out and (work / "runs/wheel/checkpoints/iter_0000005").is_dir(), out
