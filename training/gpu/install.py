"""The GPU check's installs, run after everything that needs nothing installed (``training.gpu.check``).

A lent GPU machine has no package index at all: its Python has torch, triton, nvcc and the ``nvidia-nvshmem``
wheel, and nothing else moefold's optional paths use (Transformer Engine, grouped_gemm, DeepEP, torchao). What
can reach it are wheels carried in the working tree (``--wheels DIR``): they are installed with
``pip --no-index --no-deps`` into a site folder put on ``PYTHONPATH`` for every later step (torch, already
there, is never touched). An index is probed for 4 s only when something is still missing and installs are
tried from it only when it answers; DeepEP is built from ``--deepep-src`` with >= 2 GPUs: V2 (a checkout with
``deep_ep/buffers/elastic.py``) against the NCCL of an ``nvidia-nccl`` wheel >= 2.30.4 (carried in ``--wheels``
when the machine's is older), v1.2.1 with NVSHMEM; a rehearsal states the build it would run. ``newly_importable``
then says which optional packages the later steps can use that the first ones could not.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from moefold.training.gpu.steps import Step, run, status_of, tail

if TYPE_CHECKING:
    from moefold.training.gpu.check import Check

# importable name -> what pip would install from an index
GPU_PARTS = (("transformer_engine", "transformer-engine[pytorch]"), ("grouped_gemm", "grouped-gemm"))
OPTIONAL = ("transformer_engine", "grouped_gemm", "deep_ep", "torchao")   # what later steps re-run with


def importable() -> frozenset[str]:
    """The optional packages this interpreter (with the carried wheels' site folder on its path) finds."""
    importlib.invalidate_caches()
    return frozenset(m for m in OPTIONAL if importlib.util.find_spec(m) is not None)


def _wheels(check: Check) -> tuple[list[str], bool]:
    """Install the carried wheels into a site folder put on PYTHONPATH; (report lines, ok)."""
    folder = Path(check.args.wheels)
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return [f"- wheels: no .whl in {folder}"], False
    site = Path(tempfile.mkdtemp(prefix="moefold-gpu-check-site-"))
    check.cleanup.append(site)
    rc, text, seconds = run([check.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(site),
                             *map(str, wheels)], check.budget.for_step(60, 60), check.log)
    names = ", ".join(w.name for w in wheels)
    if rc != 0:
        return [f"- wheels {names}: pip {status_of(rc)} in {seconds:.0f} s: {tail(text, 2)[:300]}"], False
    path = os.environ.get("PYTHONPATH", "")
    check.env["PYTHONPATH"] = f"{site}{os.pathsep}{path}" if path else str(site)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    lines = [f"- wheels installed into {site} (on PYTHONPATH for every later step) in {seconds:.0f} s: {names}"]
    ok = True
    for wheel in wheels:  # each distribution must import with this machine's torch
        module = wheel.name.split("-")[0].lower()
        rc, text, _ = run([check.python, "-c", f"import {module}; print(getattr({module}, '__version__', ''))"],
                          60, check.log, check.env)
        ok = ok and rc == 0
        lines.append(f"  - import {module}: " + (f"ok {text.strip().splitlines()[-1] if text.strip() else ''}"
                                                 if rc == 0 else f"FAILED: {tail(text, 1)[:300]}"))
    return lines, ok


def _index_reachable(check: Check) -> tuple[bool, str]:
    """Does the package index answer within seconds? (a subprocess: name resolution has no timeout)"""
    url = check.args.index_url
    probe = ("import sys, urllib.request\n"
             "urllib.request.urlopen(urllib.request.Request(sys.argv[1], method='HEAD'), timeout=4)\n")
    rc, text, seconds = run([check.python, "-c", probe, url], 8, check.log)
    if rc == 0:
        return True, f"package index {url} answered in {seconds:.1f} s"
    why = "no answer" if rc is None else (tail(text, 1).split(":")[-1].strip() or "error")
    return False, f"package index {url} unreachable ({why}, {seconds:.1f} s): no network"


NCCL_MIN = (2, 30, 4)   # DeepEP V2's README: NCCL 2.30.4 and above (its Gin device API)


def deepep_source(src: str) -> str | None:
    """"V2" for a DeepEP checkout with ``deep_ep/buffers/elastic.py`` (DeepEP 2.x), "v1" for one with
    ``deep_ep/buffer.py`` (v1.x), None when ``src`` is neither."""
    root = Path(src)
    if (root / "deep_ep" / "buffers" / "elastic.py").is_file():
        return "V2"
    if (root / "deep_ep" / "buffer.py").is_file():
        return "v1"
    return None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def nccl_wheel() -> tuple[str, str, str] | None:
    """(distribution, version, root folder) of the installed ``nvidia-nccl-*`` wheel (what DeepEP V2's
    ``find_nccl_root`` finds: deep_ep/utils/find_pkgs.py), or None."""
    from importlib.metadata import distributions

    found = None
    for dist in distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if not name.startswith("nvidia-nccl"):
            continue
        root = Path(str(dist.locate_file("nvidia/nccl")))
        if root.is_dir() and (found is None or _version(dist.version) > _version(found[1])):
            found = (name, dist.version, str(root))
    return found


def deepep_build(src: str, kind: str, arch: str, env: dict[str, str]) -> tuple[list[str] | None, dict[str, str], str]:
    """(the pip command that builds DeepEP from ``src``, its environment, a note), or (None, env, why not).

    V2 links the NCCL of an ``nvidia-nccl`` wheel >= 2.30.4 (``EP_NCCL_ROOT_DIR``; its legacy kernels also need the
    ``nvidia-nvshmem`` wheel the machine has) and builds its kernels at run time (the install compiles only the
    host extension); v1.2.1 compiles its kernels with NVSHMEM."""
    env = {**env, "TORCH_CUDA_ARCH_LIST": arch}
    note = ""
    if kind == "V2":
        nccl = nccl_wheel()
        if nccl is None or _version(nccl[1]) < NCCL_MIN:
            have = f"{nccl[0]} {nccl[1]}" if nccl else "no nvidia-nccl wheel"
            return None, env, (f"DeepEP V2 needs NCCL >= {'.'.join(map(str, NCCL_MIN))} from the nvidia-nccl wheel "
                               f"({have}): carry nvidia-nccl-cu12 (or -cu13) >= 2.30.4 in --wheels")
        env["EP_NCCL_ROOT_DIR"] = nccl[2]
        note = f" with {nccl[0]} {nccl[1]}"
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", src]
    return cmd, env, note


def _deepep(check: Check) -> tuple[str, bool | None]:
    """(report line, whether a build from --deepep-src passed; None when none was tried)."""
    if importlib.util.find_spec("deep_ep") is not None:
        return "- DeepEP: already installed", None
    if not check.args.deepep_src:
        return ("- DeepEP: not installed (not on PyPI: pass --deepep-src DIR, a DeepEP checkout: V2 (main) with "
                "NCCL >= 2.30.4 from the nvidia-nccl wheel, or v1.2.1)"), None
    src = check.args.deepep_src
    kind = deepep_source(src)
    if kind is None:
        return f"- DeepEP: {src} is not a DeepEP checkout (no deep_ep/buffers/elastic.py or deep_ep/buffer.py)", False
    arch = "9.0" if check.rehearsal else "{}.{}".format(*__import__("torch").cuda.get_device_capability(0))
    cmd, env, note = deepep_build(src, kind, arch, check.env)
    if cmd is None:
        return f"- DeepEP {kind} from {src}: not built: {note}", False
    if check.rehearsal or check.num_gpus < 2:
        why = "rehearsal" if check.rehearsal else f"its kernels need >= 2 GPUs; this machine has {check.num_gpus}"
        return (f"- DeepEP {kind} from {src}{note}: not built ({why}); would run: TORCH_CUDA_ARCH_LIST={arch} "
                + (f"EP_NCCL_ROOT_DIR={env['EP_NCCL_ROOT_DIR']} " if "EP_NCCL_ROOT_DIR" in env else "")
                + " ".join(cmd[1:])), None
    cmd[0] = check.python
    rc, text, seconds = run(cmd, check.budget.for_step(240, 60), check.log, env)
    line = f"- DeepEP {kind} from {src}{note}: {status_of(rc)} in {seconds:.0f} s"
    if rc != 0:
        return line + ": " + tail(text, 1)[:200], False
    probe = "import deep_ep; print(deep_ep.__version__, 'ElasticBuffer' if hasattr(deep_ep, 'ElasticBuffer') else '')"
    rc, text, _ = run([check.python, "-c", probe], 120, check.log, check.env)
    return line + (f"; import deep_ep: {tail(text, 1)}" if rc == 0 else f"; import deep_ep FAILED: {tail(text, 1)}"), \
        rc == 0


def install(check: Check) -> Step:
    """Carried wheels, then (only if an index answers) the missing ``.[gpu]`` parts, then DeepEP from source."""
    lines: list[str] = []
    ok, attempted = True, False
    if check.args.wheels:
        wheel_lines, ok = _wheels(check)
        lines += wheel_lines
        attempted = True
    missing = [(module, spec) for module, spec in GPU_PARTS if importlib.util.find_spec(module) is None]
    lines += [f"- {spec}: already installed" for module, spec in GPU_PARTS if (module, spec) not in missing]
    if missing:
        reachable, why = _index_reachable(check)
        names = ", ".join(spec for _, spec in missing)
        if not reachable:
            lines.append(f"- {why}: not installed: {names} (their tests and rows are skipped; "
                         f"carry wheels with --wheels DIR)")
        elif check.rehearsal:
            lines.append(f"- {why}; rehearsal: would install {names} from it (not attempted)")
        else:
            attempted = True
            for _module, spec in missing:
                cmd = [check.python, "-m", "pip", "install", "--no-build-isolation", "--retries", "0", "--timeout",
                       "10", "--index-url", check.args.index_url, spec]
                rc, text, seconds = run(cmd, check.budget.for_step(check.args.install_timeout, 60), check.log,
                                        {**check.env, "MAX_JOBS": str(os.cpu_count() or 4)})
                ok = ok and rc == 0
                reason = "" if rc == 0 else ": " + (tail(text, 1) or "no output")[:200]
                lines.append(f"- {spec}: {status_of(rc)} in {seconds:.0f} s{reason}")
    line, built = _deepep(check)
    lines.append(line)
    if built is not None:
        attempted, ok = True, ok and built
    status = ("passed" if ok else "failed") if attempted else "skipped"
    return Step("install", status, summary="\n".join(lines))


__all__ = ["GPU_PARTS", "NCCL_MIN", "OPTIONAL", "deepep_build", "deepep_source", "importable", "install", "nccl_wheel"]
