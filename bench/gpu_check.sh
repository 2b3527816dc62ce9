#!/usr/bin/env bash
# The GPU check of the CUDA paths, prepared to run once on a lent GPU machine (device tool):
# the CUDA tests, then the G. benchmark contenders on a 2 GB checkpoint. Needs a CUDA build
# of torch already installed there (the device machine has no network). Figures go to
# $OUT (or bench/) as gpu-tests.txt, gpu.txt, gpu.json and gpu-phases.txt. ONLY, SIZE_GB, REPEAT and SETTLE override
# the benchmark's contenders, size, rounds and settle time.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())"
pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
tests=0  # the benchmark runs even when a test fails; the script exits with the tests' status
python -m pytest -q -p no:cacheprovider -m cuda tests/ 2>&1 | tee "$out/gpu-tests.txt" || tests=$?
python -m tensorstore_h5.bench --gpu --only "${ONLY:-G.,L.readinto}" --size-gb "${SIZE_GB:-2}" --repeat "${REPEAT:-3}" \
  ${SETTLE:+--settle "$SETTLE"} --json "$out/gpu.json" 2>&1 | tee "$out/gpu.txt"
# The first load in a fresh process, staging buffers pinned by cudaHostRegister (the default) and
# through torch's pin_memory, twice each (PHASES=0 skips it).
if [ "${PHASES:-1}" != 0 ]; then
  timeout 120 python bench/gpu_phases.py "${SIZE_GB:-2}" first:2x64 first:2x64/torch first:2x64 first:2x64/torch 2>&1 \
    | tee "$out/gpu-phases.txt" || true
fi
exit "$tests"
