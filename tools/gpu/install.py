"""The GPU check's installs, run after everything that needs nothing installed (``tools.gpu.check``).

A lent GPU machine has no package index at all: its Python has torch, triton, nvcc and the ``nvidia-nvshmem``
wheel, and nothing else moefold's optional paths use (Transformer Engine, grouped_gemm, DeepEP, torchao). What
can reach it are wheels carried in the working tree (``--wheels DIR``): they are installed with
``pip --no-index --no-deps`` into a site folder put on ``PYTHONPATH`` for every later step (torch, already
there, is never touched). An index is probed for 4 s only when something is still missing and installs are
tried from it only when it answers; DeepEP is built from ``--deepep-src`` with >= 2 GPUs: V2 (a checkout with
``deep_ep/buffers/elastic.py``) against the NCCL of an ``nvidia-nccl`` wheel >= 2.30.4 (carried in ``--wheels``
when the machine's is older), v1.2.1 with NVSHMEM; a rehearsal states the build it would run. ``newly_importable``
then says which optional packages the later steps can use that the first ones could not.

A carried ``nvidia-nccl`` wheel is a library, not a module. DeepEP V2 links it and refuses at import any other
``libnccl`` mapped in the process (``dispatch.deepep_nccl``); which file torch maps depends on its build (a pip-wheel
torch loads the first ``nvidia/nccl`` on ``sys.path``, so the site folder, first on ``PYTHONPATH``, is it). The
report says which file torch maps with the later steps' environment; when it is not the wheel's it tries
``LD_PRELOAD`` of the wheel's library and keeps it for the later steps only if torch then maps that one file
(``nccl_plan``, ``preload_verdict``); else it names the upgrade in torch's environment (docs/gpus.md).
"""

from __future__ import annotations

import ast
import filecmp
import glob
import importlib
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from moefold.tools.gpu.steps import Step, run, status_of, tail

if TYPE_CHECKING:
    from moefold.tools.gpu.check import Check

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
        if module.startswith("nvidia_"):   # a library wheel (nvidia-nccl-cu12, ...): files, no module to import
            line, found = library_wheel(site, module)
            ok = ok and found
            lines.append(line)
            continue
        rc, text, _ = run([check.python, "-c", f"import {module}; print(getattr({module}, '__version__', ''))"],
                          60, check.log, check.env)
        ok = ok and rc == 0
        lines.append(f"  - import {module}: " + (f"ok {text.strip().splitlines()[-1] if text.strip() else ''}"
                                                 if rc == 0 else f"FAILED: {tail(text, 1)[:300]}"))
    return lines, ok


def library_wheel(site: Path, module: str) -> tuple[str, bool]:
    """(report line, found) for an NVIDIA library wheel installed into ``site``: its shared libraries. Said of
    NCCL: torch does not load it from there (``nccl_plan``)."""
    name = module.split("_")[1]   # nvidia_nccl_cu12 -> nccl
    libs = sorted(p.name for p in (site / "nvidia" / name / "lib").glob("lib*.so*"))
    if not libs:
        return f"  - {module}: FAILED: no shared library in {site / 'nvidia' / name / 'lib'}", False
    note = (": what DeepEP V2 builds against; torch keeps loading its own libnccl (see DeepEP below)"
            if name == "nccl" else "")
    return f"  - {module}: a library wheel, nvidia/{name}/lib/{', '.join(libs)}{note}", True


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


# DeepEP V2's README: NCCL 2.30.4 and above (its Gin device API); dispatch.deepep_nccl has the same (this module
# imports no torch, nor moefold.dispatch, which does)
NCCL_MIN = (2, 30, 4)
NCCL_MIN_TEXT = ".".join(map(str, NCCL_MIN))
# the libnccl files this interpreter's torch maps once imported (what DeepEP's check reads: deep_ep/__init__.py:55-59),
# the NCCL version torch reports and its CUDA
TORCH_NCCL_PROBE = ("import torch\n"
                    "maps = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libnccl' in l.split()[-1]})\n"
                    "try:\n    v = '.'.join(map(str, torch.cuda.nccl.version()))\nexcept Exception:\n    v = ''\n"
                    "print(repr((maps, v, torch.version.cuda)))\n")


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
    """(distribution, version, root folder) of the ``nvidia-nccl-*`` wheel first on ``sys.path``, or None: the one
    DeepEP V2's ``find_nccl_root`` finds (deep_ep/utils/find_pkgs.py: the best ``sys.path`` priority) and the one
    torch's pip wheels load (``torch/__init__.py`` ``_preload_cuda_deps``: the first ``nvidia/nccl/lib`` on
    ``sys.path``), so the carried wheel's site folder, put first, is both."""
    from importlib.metadata import distributions

    for entry in sys.path:
        for dist in distributions(path=[entry]):
            name = (dist.metadata["Name"] or "").lower().replace("_", "-")
            root = Path(str(dist.locate_file("nvidia/nccl")))
            if name.startswith("nvidia-nccl") and root.is_dir():
                return name, dist.version, str(root)
    return None


def wheel_libnccl(root: str) -> str | None:
    """The wheel's libnccl DeepEP compares the loaded one with: the first ``root/lib/libnccl.so*``
    (deep_ep/__init__.py:60-62)."""
    found = sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
    return found[0] if found else None


def nccl_plan(loaded: list[str], version: str, torch_cuda: str | None,
              wheel: tuple[str, str, str] | None) -> tuple[str, str | None]:
    """(report line, the wheel's libnccl to try under ``LD_PRELOAD``, or None when torch already maps it or nothing
    would help) from what torch maps (``TORCH_NCCL_PROBE``: ``loaded`` files, NCCL ``version``, its CUDA) and the
    ``nvidia-nccl`` wheel DeepEP V2 builds against (``nccl_wheel``). Measured, not assumed: which file torch maps
    depends on the build (dispatch/deepep_nccl.py)."""
    torch_has = f"torch maps {', '.join(loaded)} (NCCL {version or '?'})" if loaded else \
        "torch maps no libnccl" + ("" if torch_cuda else " (a CPU build)")
    if wheel is None or not torch_cuda:
        return f"  - NCCL: {torch_has}" + ("" if wheel else "; no nvidia-nccl wheel for DeepEP V2 to build against"), \
            None
    name, wheel_version, root = wheel
    lib = wheel_libnccl(root)
    if lib is None:
        return f"  - NCCL: {torch_has}; the {name} {wheel_version} wheel in {root} has no lib/libnccl.so*", None
    major = torch_cuda.split(".")[0]
    if not name.endswith(f"-cu{major}"):
        return (f"  - NCCL: {torch_has}; the {name} {wheel_version} wheel is not for this torch's CUDA "
                f"{torch_cuda}: carry nvidia-nccl-cu{major} >= {NCCL_MIN_TEXT}"), None
    if len(loaded) == 1 and _same_bytes(loaded[0], lib):
        return f"  - NCCL: {torch_has}, the library DeepEP V2 links ({name} {wheel_version})", None
    return f"  - NCCL: {torch_has}, not the {name} {wheel_version} DeepEP V2 links ({lib})", lib


def preload_verdict(loaded: list[str], lib: str, name: str) -> tuple[str, bool]:
    """(what to add to ``nccl_plan``'s line, keep ``LD_PRELOAD``) from the files torch maps under
    ``LD_PRELOAD=lib``: kept only when that is the one file mapped. A pip-wheel torch loads its own as well
    (``_preload_cuda_deps``): two files, which DeepEP refuses."""
    upgrade = f"pip install --no-deps --upgrade '{name}>={NCCL_MIN_TEXT}' into torch's environment"
    if len(loaded) == 1 and _same_bytes(loaded[0], lib):
        return f"; under LD_PRELOAD={lib} torch maps that one only: the later steps run with it ({upgrade} lasts)", \
            True
    return (f"; LD_PRELOAD={lib} does not help: torch then maps {', '.join(loaded) or 'no libnccl'} (a pip-wheel torch "
            f"loads its own from sys.path as well), which DeepEP refuses: {upgrade}"), False


def _same_bytes(a: str, b: str) -> bool:
    """DeepEP's comparison (``filecmp.cmp(..., shallow=False)``, deep_ep/__init__.py:66); a file that is gone
    differs."""
    try:
        return filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def _nccl_report(check: Check) -> tuple[str, str | None]:
    """``nccl_plan`` from what torch maps with the later steps' environment, the ``LD_PRELOAD`` it proposes tried
    and kept only when it works (``preload_verdict``): (report line, ``LD_PRELOAD`` for the later steps or None)."""
    found, wheel = _torch_nccl(check, {}), nccl_wheel()
    if found is None:
        return "  - NCCL: could not ask torch which libnccl it maps", None
    line, lib = nccl_plan(*found, wheel)
    if lib is None or wheel is None:
        return line, None
    under = _torch_nccl(check, {"LD_PRELOAD": lib})
    more, keep = preload_verdict(under[0] if under else [], lib, wheel[0])
    return line + more, lib if keep else None


def _torch_nccl(check: Check, extra: dict[str, str]) -> tuple[list[str], str, str | None] | None:
    """``TORCH_NCCL_PROBE``'s answer in a subprocess with the later steps' environment (and ``extra``), or None
    when it fails."""
    rc, text, _ = run([check.python, "-c", TORCH_NCCL_PROBE], 60, check.log, {**check.env, **extra})
    try:
        loaded, version, cuda = ast.literal_eval(text.strip().splitlines()[-1]) if rc == 0 else (None,) * 3
    except (ValueError, SyntaxError, IndexError):
        return None
    return None if loaded is None else (loaded, version, cuda)


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
            return None, env, (f"DeepEP V2 needs NCCL >= {NCCL_MIN_TEXT} from the nvidia-nccl wheel "
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
    root = f"EP_NCCL_ROOT_DIR={env['EP_NCCL_ROOT_DIR']} " if "EP_NCCL_ROOT_DIR" in env else ""
    would = f"would run: TORCH_CUDA_ARCH_LIST={arch} {root}{' '.join(cmd[1:])}"
    if check.rehearsal:
        return f"- DeepEP {kind} from {src}{note}: not built (rehearsal); {would}", None
    nccl, preload = "", None
    if kind == "V2":   # which libnccl torch maps, against the one DeepEP links
        nccl, preload = _nccl_report(check)
        nccl = "\n" + nccl
    if check.num_gpus < 2:
        return (f"- DeepEP {kind} from {src}{note}: not built (its kernels need >= 2 GPUs; this machine has "
                f"{check.num_gpus}); {would}{nccl}"), None
    cmd[0] = check.python
    rc, text, seconds = run(cmd, check.budget.for_step(240, 60), check.log, env)
    line = f"- DeepEP {kind} from {src}{note}: {status_of(rc)} in {seconds:.0f} s"
    if rc != 0:
        return line + ": " + tail(text, 1)[:200] + nccl, False
    if preload:   # every later step imports deep_ep under it (pytest, bench-dispatch, train)
        check.env["LD_PRELOAD"] = " ".join(p for p in (preload, check.env.get("LD_PRELOAD", "")) if p)
    ok, imported = _import_deep_ep(check)
    return f"{line}; import deep_ep: {imported}{nccl}", ok


def _import_deep_ep(check: Check) -> tuple[bool, str]:
    """Import ``deep_ep`` as the flex dispatcher does (``dispatch.deepep_nccl.import_deep_ep``: a refused libnccl is
    one line naming both files and the fix) with the later steps' environment: (ok, version or that line)."""
    probe = ("from moefold.dispatch.deepep_nccl import import_deep_ep\n"
             "d = import_deep_ep('deep_ep is not installed')\n"
             "print(d.__version__, 'ElasticBuffer' if hasattr(d, 'ElasticBuffer') else '')\n")
    rc, text, _ = run([check.python, "-c", probe], 120, check.log, check.env)
    return rc == 0, tail(text, 1) if rc == 0 else f"FAILED: {tail(text, 1)}"


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


__all__ = ["GPU_PARTS", "NCCL_MIN", "OPTIONAL", "TORCH_NCCL_PROBE", "deepep_build", "deepep_source", "importable",
           "install", "library_wheel", "nccl_plan", "nccl_wheel", "preload_verdict", "wheel_libnccl"]
