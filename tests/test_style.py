"""The tree is ruff-clean under the configuration in pyproject.toml."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the [test] extra")
def test_ruff_clean():
    result = subprocess.run(["ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the [test] extra")
def test_bare_folder_imports_are_rejected(tmp_path):
    """The lint rule that keeps `import moe` / `from training import ...` out of the tree fires."""
    bad = tmp_path / "bad.py"
    bad.write_text("import moe\nfrom training.cli import main\nfrom dense import linear\nimport models.hf\n")
    result = subprocess.run(["ruff", "check", "--config", str(ROOT / "pyproject.toml"), "--select", "TID251",
                             str(bad)], capture_output=True, text=True)
    assert result.returncode != 0
    for name in ("moe", "training", "dense", "models"):
        assert f"`{name}` is banned" in result.stdout, result.stdout
