#!/usr/bin/env bash
# moefold's GPU check from a bare checkout on a machine with NVIDIA GPU(s): make moefold importable
# (an editable install without dependencies, or a symlink shim where pip cannot install), then run
# `python -m moefold.training.gpu_check` (tests/gpu, GPU benchmarks, one Markdown report).
#
#   bash scripts/gpu_check.sh --out report.md [--budget 470] [--wheels DIR] [--deepep-src DIR]
#
# The whole run is bounded by GPU_CHECK_TIMEOUT seconds (default 540); the report is written
# after every step, so it exists whatever happens.
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
if ! "$PY" -c "import moefold.training.gpu_check" 2>/dev/null; then
  timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/tmp/moefold-gpu-check-pip.log 2>&1 \
    || echo "gpu_check.sh: editable install failed (see /tmp/moefold-gpu-check-pip.log); using a symlink shim"
fi
if ! "$PY" -c "import moefold.training.gpu_check" 2>/dev/null; then
  shim=$(mktemp -d)
  mkdir -p "$shim/moefold"
  for f in parallel dense moe dispatch pipeline models training; do ln -s "$PWD/$f" "$shim/moefold/$f"; done
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT:-540}" "$PY" -m moefold.training.gpu_check "$@"
