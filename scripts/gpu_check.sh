#!/usr/bin/env bash
# moefold's GPU check from a bare checkout on a machine with NVIDIA GPU(s), with or without a package index:
# make moefold importable (an editable install that touches no index and installs no dependency: torch and
# the rest are taken as they are; or a symlink shim where pip cannot install), then run
# `python -m moefold.tools.gpu.check`: what needs nothing installed first (torch API, host syncs, a proxy
# training run, the MoE layer against dense, tests/gpu, --compile), then the carried wheels and what they add.
#
#   bash scripts/gpu_check.sh --out report.md [--wheels DIR] [--budget 440] [--deepep-src DIR]
#   bash scripts/gpu_check.sh --rehearsal --out report.md      # the same steps on the CPU, tiny sizes
#
# The whole script, install included, ends within GPU_CHECK_TIMEOUT seconds (default 470: under 8 minutes);
# the check's budget is clamped to that deadline and its report is written after every step.
set -u
cd "$(dirname "$0")/.." || exit 1
start=$(date +%s)
total=${GPU_CHECK_TIMEOUT:-470}
PY=${PYTHON:-python3}
how="already installed"
if ! "$PY" -c "import moefold.tools.gpu.check" 2>/dev/null; then
  how="editable install (pip --no-index --no-deps --no-build-isolation -e .)"
  if ! timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check \
      -e . >/tmp/moefold-gpu-check-pip.log 2>&1; then
    echo "gpu_check.sh: editable install failed, using a symlink shim; pip said:"
    tail -n 3 /tmp/moefold-gpu-check-pip.log
  fi
fi
if ! "$PY" -c "import moefold.tools.gpu.check" 2>/dev/null; then
  how="symlink shim on PYTHONPATH (the editable install failed: /tmp/moefold-gpu-check-pip.log)"
  shim=$(mktemp -d)
  mkdir -p "$shim/moefold"
  for f in parallel precision dense moe dispatch models execution pipeline training planner tools; do ln -s "$PWD/$f" "$shim/moefold/$f"; done
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "gpu_check.sh: moefold: $how"
export MOEFOLD_GPU_CHECK_INSTALL="$how"
left=$(( total - ($(date +%s) - start) ))
# the check plans its steps to end 15 s before this deadline; timeout is the backstop
export MOEFOLD_GPU_CHECK_DEADLINE=$(( $(date +%s) + left - 10 ))
exec timeout --kill-after=5 "$(( left - 5 ))" "$PY" -m moefold.tools.gpu.check "$@"
