"""The wheel installs one top-level package, ``moefold``, that works from any working directory.

Builds the wheel, installs it into a fresh virtual environment that sees this interpreter's
packages (so the CPU torch is reused and nothing is downloaded), and runs moefold from a directory
holding a user's own ``models/`` and ``training/`` packages, which must not shadow moefold's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
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
    # no build isolation: setuptools is already here, and CI must not depend on the index for it
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out),
          str(ROOT)], cwd=ROOT, env=dict(os.environ))
    (whl,) = out.glob("moefold-*.whl")
    return whl


def test_wheel_has_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"moefold"}, sorted(tops)
    for package in ("parallel", "dense", "moe", "dispatch", "pipeline", "models", "models/hf", "training",
                    "training/data"):
        assert f"moefold/{package}/__init__.py" in names
    assert not any(n.startswith("moefold/tests/") for n in names)


def test_installed_wheel_runs_beside_a_users_own_packages(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    python, moefold = env_dir / "bin" / "python", env_dir / "bin" / "moefold"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path, env=env)

    work = tmp_path / "project"  # a user's project with packages named like moefold's folders
    for name in ("models", "training"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text("raise ImportError('the user project shadowed moefold')\n")

    assert "moefold: 0.1.0" in _run([str(moefold), "env"], cwd=work, env=env)
    where = _run([str(python), "-c", "import moefold.moe, moefold.training; print(moefold.moe.__file__)"],
                 cwd=work, env=env)
    assert where.strip().startswith(str(env_dir)), where  # the wheel's copy, not the checkout
    out = _run([str(moefold), "train", "--recipe", "qwen3_moe_tiny", "--train-iters", "5", "--log-interval", "1"],
               cwd=work, env=env, timeout=600)
    assert "done: 5 steps" in out and (work / "runs/moefold/checkpoints/iter_0000005").is_dir(), out
