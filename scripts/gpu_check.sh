#!/usr/bin/env bash
# moefold's GPU check from a bare checkout on a machine with NVIDIA GPU(s), network or not: make
# moefold importable (an editable install that touches no index and no build dependency, or a
# symlink shim where pip cannot install), then run `python -m moefold.training.gpu.check`
# (host syncs, a proxy training run, the MoE layer benchmark, tests/gpu; one Markdown report).
#
#   bash scripts/gpu_check.sh --out report.md [--wheels .whl] [--budget 440] [--deepep-src DIR]
#   bash scripts/gpu_check.sh --rehearsal --out report.md      # the same steps on the CPU, tiny sizes
#
# The check is bounded by GPU_CHECK_TIMEOUT seconds (default 480, with the budget of 440 s inside
# it); the report is written after every step, so it exists whatever happens.
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
how="already installed"
if ! "$PY" -c "import moefold.training.gpu.check" 2>/dev/null; then
  how="editable install (pip --no-index --no-deps --no-build-isolation -e .)"
  if ! timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check \
      -e . >/tmp/moefold-gpu-check-pip.log 2>&1; then
    echo "gpu_check.sh: editable install failed, using a symlink shim; pip said:"
    tail -n 3 /tmp/moefold-gpu-check-pip.log
  fi
fi
if ! "$PY" -c "import moefold.training.gpu.check" 2>/dev/null; then
  how="symlink shim on PYTHONPATH (the editable install failed: /tmp/moefold-gpu-check-pip.log)"
  shim=$(mktemp -d)
  mkdir -p "$shim/moefold"
  for f in parallel dense moe dispatch pipeline models training; do ln -s "$PWD/$f" "$shim/moefold/$f"; done
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "gpu_check.sh: moefold: $how"
export MOEFOLD_GPU_CHECK_INSTALL="$how"
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT:-480}" "$PY" -m moefold.training.gpu.check "$@"
