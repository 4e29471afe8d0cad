"""``moefold train --help`` and a mistyped flag answer before torch is imported (issue 48 item 8).

Parsing ``moefold train``'s flags imports only torch-free modules (the flags' table, the configs' names and
defaults: ``training.cli.train_flags``, ``dense.choices``, ``moe.gemm_backend``, ``parallel.sizes``...), so the answer
does not wait for torch and ``torch._dynamo`` (seconds, more under load). Checked by what a fresh interpreter has
imported after parsing, not by timing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PARSE = """
import contextlib, io, json, sys
from moefold.training.cli import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        main(json.loads(sys.argv[1]))
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "out": out.getvalue(),
                  "heavy": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:5]}))
"""


@pytest.mark.parametrize("argv, says", [
    (["train", "--tens", "2"], "did you mean --tensor-model-parallel-size?"),
    (["train", "--help"], "--moe-token-dispatcher-type"),
    (["train", "--recipe", "qwen3_moe_tiny", "--moe-token-dispatcher-type", "alltoal"], "did you mean alltoall"),
])
def test_train_parses_without_torch(argv, says):
    run = subprocess.run([sys.executable, "-c", PARSE, json.dumps(argv)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["code"] in (0, 2) and says in result["out"], result
    assert result["heavy"] == [], f"parsing {argv} imported {result['heavy']}"
