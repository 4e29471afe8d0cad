"""What DeepEP needs of NCCL (``dispatch.deepep_nccl``), on the CPU.

- The communicator: DeepEP V2 reuses torch's communicator of the group and caches it at its first call, null
  when the group has run no collective (tests/dispatch/deepep_elastic_comm.py models it over gloo: the stand-in
  refuses what would crash the real library, and keeps refusing after a later collective, as DeepEP's cache
  does). The flex dispatcher built the way ``moefold train`` builds it (groups from the device mesh, on which
  nothing has run yet) forms the communicator before DeepEP first sees the group (``ElasticBuffers``).
- The library: DeepEP's import-time libnccl check, failed, becomes one line naming the loaded file, the linked
  one, the NCCL DeepEP V2 needs and the fix, on every path that imports ``deep_ep`` (a fake ``deep_ep`` package
  raising DeepEP's own assertion text).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from tests.dispatch import deepep_elastic_comm, deepep_elastic_standin
from tests.dispatch.common import make_case, make_routing
from tests.distributed import run_distributed

E, H, T = 4, 32, 6


def _standin_keeps_the_null_communicator(reuse: str) -> list[str]:
    standin = deepep_elastic_standin.module()
    EB, problems = standin.ElasticBuffer, []
    fresh = dist.new_group([0, 1])
    if reuse == "0":   # DeepEP makes its own communicator (comm.py:66-75): nothing needs forming
        import os

        os.environ["EP_REUSE_NCCL_COMM"] = "0"
        EB.get_buffer_size_hint(fresh, 8, H)
        return problems
    for when in ("before any collective", "after a collective (DeepEP cached the null one)"):
        try:
            EB.get_buffer_size_hint(fresh, 8, H)
            problems.append(f"a size hint on a group {when} was accepted")
        except RuntimeError as err:
            if "comm.py:61-64" not in str(err):
                problems.append(f"{when}: {err}")
        dist.barrier(group=fresh)
    formed = dist.new_group([0, 1])
    dist.barrier(group=formed)
    if EB.get_buffer_size_hint(formed, 8, H) <= 0:
        problems.append("a formed group's size hint")
    EB(formed, num_max_tokens_per_rank=8, hidden=H, explicitly_destroy=True).destroy()
    return problems


@pytest.mark.parametrize("reuse", ["1", "0"])
def test_the_standin_refuses_an_unformed_communicator_as_deepep_breaks(reuse):
    assert run_distributed(_standin_keeps_the_null_communicator, 2, reuse) == [[], []]


def _flex_as_train_builds_it() -> tuple[int, int, int]:
    from moefold.dispatch import DispatchConfig, DispatcherKind, FlexBackend, FlexOptions, build_dispatcher
    from moefold.dispatch.deepep_elastic import ElasticBuffers
    from moefold.parallel import ParallelConfig, ParallelDims

    sys.modules["deep_ep"] = deepep_elastic_standin.module()
    dims = ParallelDims.build(ParallelConfig(ep=2))   # the groups as the trainer makes them: nothing run on them
    before = dims.etp_ep_group._get_sequence_number_for_group()
    buffers = ElasticBuffers()
    config = DispatchConfig(DispatcherKind.FLEX, FlexOptions(FlexBackend.DEEPEP, max_tokens_per_rank=T))
    flex = build_dispatcher(config, E, dims, hidden_size=H, buffers=buffers)
    rank = dist.get_rank()
    x, ids, probs = make_case("random", [T, T], E, hidden=H)
    mine = slice(rank * T, (rank + 1) * T)
    out = flex.dispatch(x[mine].to(torch.bfloat16), make_routing(probs[mine], ids[mine], E, "dropless", T))
    y = flex.combine(out.tokens_NH, out.handle)
    assert y.shape == (T, H)
    made = buffers.destroy()
    return before, len(deepep_elastic_comm.STORAGE), made


def test_the_flex_dispatcher_forms_the_communicator_before_deepep_reuses_it():
    """Without ``start_communicator`` in ``ElasticBuffers.get`` DeepEP's first call (the size hint) meets a group
    that has run no collective: the stand-in refuses it, as the real library crashes on it."""
    results = run_distributed(_flex_as_train_builds_it, 2)
    assert results == [(0, 1, 1)] * 2, results


# -------------------------------------------------------------------------------- the import-time libnccl check
LOADED = "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"
LINKED = "/tmp/moefold-gpu-check-site-x/nvidia/nccl/lib/libnccl.so.2"
# deep_ep/__init__.py:66-68 at dd758ca, verbatim but for the paths
MISMATCH = (f"Invalid NCCL versions: {LOADED} (loaded) v.s. {LINKED} (expected), please contact Chenggang or "
            f"Shangyan to upgrade PyTorch NCCL version")


def _fake_deep_ep(tmp_path, monkeypatch, body: str) -> None:
    pkg = tmp_path / "deep_ep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)


def _one_line_from_every_import(tmp_path, monkeypatch, body: str) -> list[str]:
    from moefold.dispatch.deepep import import_deep_ep
    from moefold.dispatch.deepep_elastic import import_elastic
    from moefold.dispatch.flex_backend import describe_flex_backend, resolve_flex_backend

    _fake_deep_ep(tmp_path, monkeypatch, body)
    lines = []
    for load in (import_elastic, import_deep_ep, lambda: resolve_flex_backend("auto"),
                 lambda: resolve_flex_backend("deepep"), lambda: describe_flex_backend("deepep")):
        with pytest.raises(ImportError) as err:
            load()
        lines.append(str(err.value))
    assert all("\n" not in line for line in lines), lines
    return lines


def test_a_refused_libnccl_is_one_line_with_both_files_and_the_fix(tmp_path, monkeypatch):
    from moefold.dispatch.deepep_nccl import nccl_wheel_name

    lines = _one_line_from_every_import(tmp_path, monkeypatch, f"assert False, {MISMATCH!r}\n")
    assert len(set(lines)) == 1, lines
    line = lines[0]
    assert f"torch loaded {LOADED}" in line and f"linked against {LINKED}" in line and ">= 2.30.4" in line, line
    assert f"pip install --no-deps --upgrade '{nccl_wheel_name()}>=2.30.4' into the environment torch" in line, line
    assert "put /tmp/moefold-gpu-check-site-x ahead of it on PYTHONPATH" in line and f"LD_PRELOAD={LINKED} only" in line


@pytest.mark.parametrize("message, says", [
    ("Duplicate NCCL runtime found in the current system: /a/libnccl.so.2 and /b/libnccl.so.2",
     "two libnccl files are mapped in this process, /a/libnccl.so.2 and /b/libnccl.so.2"),
    ("No libnccl.so found in /gone/nvidia/nccl/lib/", "finds no libnccl in /gone/nvidia/nccl/lib/"),
    ("Cannot find package: nccl", "finds no nvidia-nccl wheel"),
])
def test_deepeps_other_nccl_checks_are_one_line(tmp_path, monkeypatch, message, says):
    line = _one_line_from_every_import(tmp_path, monkeypatch, f"assert False, {message!r}\n")[0]
    assert says in line and "pip install --no-deps --upgrade" in line, line


def test_a_missing_deepep_and_a_broken_one_are_told_apart(tmp_path, monkeypatch):
    from moefold.dispatch.deepep_elastic import V2_INSTALL_HINT, import_elastic

    monkeypatch.setitem(sys.modules, "deep_ep", None)   # not installed
    with pytest.raises(ImportError, match="needs DeepEP V2") as err:
        import_elastic()
    assert str(err.value) == V2_INSTALL_HINT
    lines = _one_line_from_every_import(tmp_path, monkeypatch, "import deep_ep_cpp_missing_extension\n")
    assert "deep_ep_cpp_missing_extension" in lines[0] and "installed but" in lines[0], lines[0]
