"""How the ranks start torch.distributed (``parallel.init.init_process_group_on``): NCCL bound to the rank's GPU,
gloo without a device, and no launcher of moefold's starting NCCL any other way.

NCCL bound to the device (``device_id``) forms its communicators when the groups are made; left lazy, a group's
communicator is null until its first collective, and DeepEP V2, which reuses it, breaks (dispatch.deepep_nccl).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moefold.parallel import init as parallel_init

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("parallel", "precision", "dense", "dispatch", "moe", "models", "pipeline", "training", "planner", "tools")


def test_nccl_is_bound_to_the_gpu_and_gloo_takes_no_device(monkeypatch):
    calls, devices = [], []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    parallel_init.init_process_group_on(torch.device("cuda", 3), rank=1, world_size=4)
    parallel_init.init_process_group_on(torch.device("cpu"), rank=1, world_size=4)
    assert calls == [(("nccl",), {"device_id": torch.device("cuda", 3), "rank": 1, "world_size": 4}),
                     (("gloo",), {"rank": 1, "world_size": 4})]
    assert devices == [torch.device("cuda", 3)]
    with pytest.raises(ValueError, match="needs its index"):
        parallel_init.init_process_group_on(torch.device("cuda"))


def _init_calls(path: Path) -> list[tuple[int, str]]:
    """(line, first argument) of each ``init_process_group(...)`` call in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == \
                "init_process_group":
            first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "backend"), None)
            found.append((node.lineno, ast.unparse(first) if first is not None else "<default>"))
    return found


def test_every_launcher_starts_nccl_through_init_process_group_on():
    """Only ``init_process_group_on`` may start NCCL; elsewhere a backend fixed to gloo (or the planner's fake)."""
    wrong = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for line, backend in _init_calls(path):
                inside = path == REPO / "parallel" / "init.py" and backend in ("'nccl'", "'gloo'")
                if not inside and backend not in ("'gloo'", "'fake'"):
                    wrong.append(f"{path.relative_to(REPO)}:{line}: init_process_group({backend}, ...)")
    assert not wrong, "start NCCL with parallel.init.init_process_group_on (device_id):\n" + "\n".join(wrong)
