#!/usr/bin/env bash
# The tolerance-sensitive equality tests once more with the kernels torch picks on another CPU kind (issue 48:
# a bound derived on an AMX Xeon failed on an AVX-512 EPYC). ATEN_CPU_CAPABILITY makes torch dispatch to a
# lower kernel level than this CPU's: on an AVX-512 machine the AVX2 kernels (other blockings, other
# summation orders), on an AVX2 machine the portable DEFAULT ones. Elsewhere (Arm, ...) there is no other
# x86 level to pick and the script says so. Run by .ci/run after the suite; about a minute on 2 idle cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
native=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
case "$native" in
  AVX512*) other=avx2 ;;
  AVX2) other=default ;;
  *) echo "other_cpu_kind.sh: torch's kernel level here is $native: no other x86 level to compare; skipped"; exit 0 ;;
esac
got=$(ATEN_CPU_CAPABILITY=$other "$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
echo "other_cpu_kind.sh: the equality tests with ATEN_CPU_CAPABILITY=$other ($got kernels; natively $native)"
ATEN_CPU_CAPABILITY=$other "$PY" -m pytest -q -p no:cacheprovider \
  tests/models/test_parallel.py tests/models/test_families_parallel.py \
  tests/execution/test_split_backward.py tests/moe/test_split_gemm.py tests/test_tolerance.py
