"""Check the import contract (``[tool.importlinter]`` in pyproject.toml) on this checkout.

    python scripts/lint_imports.py                      # what .ci/run runs before the tests
    python scripts/lint_imports.py --replace dense=DIR  # the contract on a tree whose dense/ is DIR

import-linter (built on grimp) finds a package's modules on the file system under its import path, and an
editable install of moefold has none: setuptools maps ``moefold.dense`` to ``dense/`` through an import hook.
So this script lays the installed layout out as a directory of links (``TMP/moefold/dense -> dense/``, one
per folder in setup.py's ``package_dir``) and runs ``lint-imports`` with that directory first on the path.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def folders() -> list[str]:
    """setup.py's ``FOLDERS`` (the installed subpackages), read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FOLDERS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise SystemExit("lint_imports: setup.py has no FOLDERS list")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--replace", action="append", default=[], metavar="FOLDER=DIR",
                        help="lay DIR out as moefold.FOLDER instead of the checkout's FOLDER/")
    args = parser.parse_args(argv)
    paths = {f: ROOT / f for f in folders()}
    for item in args.replace:
        name, _, where = item.partition("=")
        if name not in paths or not where:
            parser.error(f"--replace {item!r}: expected FOLDER=DIR with FOLDER one of {', '.join(paths)}")
        paths[name] = Path(where).resolve()
    with tempfile.TemporaryDirectory(prefix="moefold-imports-") as tmp:
        pkg = Path(tmp, "moefold")
        pkg.mkdir()
        for name, path in paths.items():
            (pkg / name).symlink_to(path, target_is_directory=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        # grimp caches the graph per directory; a fresh temporary directory each run makes the cache useless
        cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; "
               "sys.exit(c())", str(ROOT / "pyproject.toml"), "--no-cache"]
        return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
