"""The layer order of ARCHITECTURE.md holds (import-linter, ``[tool.importlinter]`` in pyproject.toml), and the
check fails for an import that goes upwards: between packages, and between training's parts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("importlinter", reason="import-linter is installed by the [test] extra")


def lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "lint_imports.py"), *args],
                          capture_output=True, text=True, timeout=300)


def copy_with(tmp_path: Path, folder: str, module: str, source: str) -> Path:
    """A copy of ``folder/`` with one extra module ``module`` (a path inside it) holding ``source``."""
    copy = tmp_path / folder
    shutil.copytree(ROOT / folder, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / module).write_text(source)
    return copy


def test_the_tree_keeps_the_layer_order():
    result = lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_between_packages_breaks_the_contract(tmp_path):
    dense = copy_with(tmp_path, "dense", "_upward.py", "import moefold.training.trainer\n")
    result = lint("--replace", f"dense={dense}")
    assert result.returncode != 0
    assert "moefold.dense is not allowed to import moefold.training" in result.stdout, result.stdout
    assert "moefold.dense._upward -> moefold.training.trainer" in result.stdout


def test_an_upward_import_inside_training_breaks_the_contract(tmp_path):
    # the optimizer must not know the trainer: a function-level import counts too
    training = copy_with(tmp_path, "training", "optim/_upward.py",
                         "def f():\n    from moefold.training.trainer import Trainer\n    return Trainer\n")
    result = lint("--replace", f"training={training}")
    assert result.returncode != 0
    assert "moefold.training.optim is not allowed to import moefold.training.trainer" in result.stdout, result.stdout
