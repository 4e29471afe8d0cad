"""What DeepEP needs of NCCL: the ``libnccl`` torch loaded, and (V2) torch's communicator of the group, formed.

**The library** (``import_deep_ep``). DeepEP 2.x checks at import (``deep_ep/__init__.py`` ``check_nccl_so``,
lines 46-83 at dd758ca) that exactly one ``libnccl`` is mapped in this process and that it is byte for byte the one
DeepEP was linked against: the ``nvidia-nccl-cu*`` wheel its ``find_nccl_root`` finds (``EP_NCCL_ROOT_DIR``, which
its build records, else the wheel first on ``sys.path``; ``deep_ep/utils/find_pkgs.py``), and V2 needs NCCL >= 2.30.4
there (its README). The mapped one is torch's, and which file that is depends on how torch finds it: torch's pip
wheels load ``nvidia/nccl/lib/libnccl.so*`` from the *first* ``sys.path`` entry that has one, by path, before
``libtorch_cuda.so`` needs it (``torch/__init__.py`` ``_preload_cuda_deps``); other builds take what
``libtorch_cuda.so``'s rpath or the system gives. So a newer wheel in a folder *after* torch's environment on the
path changes what DeepEP links and not what torch loads, and the import fails; ``LD_PRELOAD`` of the wheel's
library makes a pip-wheel torch map two (its own preload still loads its own file), which DeepEP refuses too
(measured on torch 2.11.0+cu130: one file with the wheel's folder first on ``PYTHONPATH``, two with ``LD_PRELOAD``
alone). What works is one library for both: upgrade the ``nvidia-nccl-cu<CUDA major>`` package in the environment
torch imports from (``pip install --no-deps --upgrade``), or put the folder holding the wheel ahead of it on
``PYTHONPATH``; ``LD_PRELOAD`` only for a torch that does not load NCCL itself. ``import_deep_ep`` turns DeepEP's
failed check into one line that names both files and the fix.

**The communicator** (``start_communicator``). DeepEP V2 does not create its own NCCL communicator: it takes torch's,
``group._get_backend(cuda)._comm_ptr()``, and caches it per group for the process (``deep_ep/utils/comm.py:57-64``,
``get_nccl_comm_handle``). torch's ``ProcessGroupNCCL`` forms that communicator at the group's first collective,
unless the default group was initialised with ``device_id`` (then at once, sub-groups split from it); before,
``_comm_ptr()`` is 0. DeepEP's first call on the group, ``ElasticBuffer.get_buffer_size_hint``, would cache the 0 and
pass it to ``ncclTeamWorld`` (``csrc/kernels/backend/nccl.cu:51``): the process dies. moefold binds NCCL to the
device (``parallel.init.init_process_group_on``) *and* runs one all-reduce on the flex group before DeepEP first
sees it (``dispatch.deepep_elastic.ElasticBuffers``), so neither a launcher without ``device_id`` nor a group made
lazily reaches DeepEP unformed (measured on torch 2.11.0+cu130: without ``device_id`` the world group, a ``new_group``
and the device mesh's group all give 0 before their first collective; with it, non-zero at once). DeepEP's legacy
``Buffer`` (v1 API) exchanges its own handles with ``all_gather_object`` and needs neither.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

NCCL_MIN = (2, 30, 4)   # DeepEP V2's README: NCCL 2.30.4 and above (its Gin device API)
NCCL_MIN_TEXT = ".".join(map(str, NCCL_MIN))


def nccl_wheel_name() -> str:
    """The ``nvidia-nccl`` distribution that matches this torch's CUDA (cu12 or cu13)."""
    cuda = torch.version.cuda
    return f"nvidia-nccl-cu{cuda.split('.')[0]}" if cuda else "nvidia-nccl-cu12"


def nccl_fix(linked: str | None) -> str:
    """How to make torch load the ``libnccl`` DeepEP links (``linked``: that file, when known)."""
    path = Path(linked) if linked else None
    site = str(path.parents[3]) if path and path.parent.parts[-3:] == ("nvidia", "nccl", "lib") else \
        "the folder holding the wheel"
    preload = f"LD_PRELOAD={linked}" if linked else "LD_PRELOAD of the wheel's libnccl.so.2"
    return (f"make them one library: pip install --no-deps --upgrade '{nccl_wheel_name()}>={NCCL_MIN_TEXT}' into the "
            f"environment torch imports from, or put {site} ahead of it on PYTHONPATH (torch's pip wheels load the "
            f"first nvidia/nccl on sys.path); {preload} only for a torch that does not load NCCL itself (docs/gpus.md, "
            f"DeepEP and NCCL)")


_MISMATCH = re.compile(r"Invalid NCCL versions: (\S+) \(loaded\) v\.s\. (\S+) \(expected\)")
_DUPLICATE = re.compile(r"Duplicate NCCL runtime found in the current system: (\S+) and (\S+)")
_NO_LIB = re.compile(r"No libnccl\.so found in (\S+)")


def nccl_check_failure(message: str) -> str:
    """One line for DeepEP's failed import-time NCCL check (``deep_ep/__init__.py:46-67``; ``message``: its
    AssertionError's text): what was loaded, what DeepEP linked, what V2 needs, the fix."""
    need = f"DeepEP V2 needs NCCL >= {NCCL_MIN_TEXT}"
    if m := _MISMATCH.search(message):
        loaded, linked = m.groups()
        return (f"import deep_ep: torch loaded {loaded} but DeepEP was linked against {linked} and refuses to run "
                f"on another libnccl ({need}): {nccl_fix(linked)}")
    if m := _DUPLICATE.search(message):
        return (f"import deep_ep: two libnccl files are mapped in this process, {m.group(1)} and {m.group(2)} (an "
                f"LD_PRELOAD with a pip-wheel torch, which loads its own as well?), and DeepEP accepts one ({need}): "
                f"{nccl_fix(None)}")
    if m := _NO_LIB.search(message):
        return (f"import deep_ep: DeepEP finds no libnccl in {m.group(1)} (EP_NCCL_ROOT_DIR or the nvidia-nccl "
                f"wheel it was built with is gone; {need}): {nccl_fix(None)}")
    if "Cannot find package: nccl" in message:
        return (f"import deep_ep: DeepEP finds no nvidia-nccl wheel (set EP_NCCL_ROOT_DIR to the NCCL it was "
                f"built with; {need}): {nccl_fix(None)}")
    first = message.strip().splitlines()[0] if message.strip() else "AssertionError"
    return f"import deep_ep failed its start-up checks: {first}"


def import_deep_ep(missing_hint: str) -> Any:
    """``deep_ep``, or ImportError of one line: ``missing_hint`` when it is not installed, DeepEP's NCCL check
    restated (``nccl_check_failure``) when it refuses this process's ``libnccl``, the first line of anything else
    that stops its import (e.g. its extension cannot load a library)."""
    try:
        return importlib.import_module("deep_ep")
    except ModuleNotFoundError as exc:
        if exc.name != "deep_ep":
            raise ImportError(f"import deep_ep: {exc} (DeepEP is installed but needs it)") from exc
        raise ImportError(missing_hint) from exc
    except AssertionError as exc:   # check_nccl_so and find_nccl_root assert
        raise ImportError(nccl_check_failure(str(exc))) from exc
    except ImportError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ImportError(f"import deep_ep failed: {first} (DeepEP is installed but does not load)") from exc


def start_communicator(group: dist.ProcessGroup, device: torch.device) -> None:
    """Form torch's communicator of ``group`` on ``device`` before DeepEP V2 first asks for it (module docstring):
    one all-reduce of one element over ``group`` (collective: every rank of the group calls it). On CUDA, a
    communicator still 0 afterwards is refused here, in one line, instead of crashing inside DeepEP."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    if device.type != "cuda":
        return
    backend = group._get_backend(device)
    if hasattr(backend, "_comm_ptr") and backend._comm_ptr() == 0:
        raise RuntimeError(f"torch's NCCL communicator of the flex dispatcher's group is still null after a "
                           f"collective on {device}; DeepEP V2 would crash on it (deep_ep/utils/comm.py:57-64): set "
                           f"EP_REUSE_NCCL_COMM=0 to let DeepEP create its own")


__all__ = ["NCCL_MIN", "import_deep_ep", "nccl_check_failure", "nccl_fix", "nccl_wheel_name", "start_communicator"]
