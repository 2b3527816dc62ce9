#!/usr/bin/env bash
# The GPU check of the CUDA paths, prepared to run once on a lent GPU machine (device tool):
# the CUDA tests, then the G. benchmark contenders (bench/README.md), then the first load's
# phases. Needs a CUDA build of torch already installed there (the device machine has no
# network); the GPU peers it lacks (fastsafetensors, kvikio) are installed from .whl/ when the
# call carries it (bench/gpu_wheels.sh fills it beforehand, on a machine with PyPI):
#   run(command="SETTLE=1 bash bench/gpu_check.sh", carry=[".whl"], timeout_s=560)
# Figures go to $OUT (or bench/) as gpu-tests.txt, gpu.txt, gpu.json and gpu-phases.txt; each
# stage's start is logged with the seconds since the script began. ONLY, SIZE_GB, REPEAT and
# SETTLE override the benchmark's contenders, size, rounds and settle time; PHASES=0 skips the
# phases.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench}"
began=$SECONDS
stage() { echo "== [$((SECONDS - began)) s] $*"; }
stage "start"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())"
site=""
if compgen -G ".whl/*.whl" >/dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && site=/tmp/site || echo "note: the carried wheels did not install; their contenders will be skipped"
fi
python -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || true
python -c "import tensorstore_h5" 2>/dev/null || site="$PWD${site:+:$site}"  # not installed: from the checkout
[ -n "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# fastsafetensors dlopens "libcudart.so", which a pip-installed torch ships only as libcudart.so.<major>:
# where no unversioned one is found, one is linked to torch's (the workaround a user of it needs).
if ! python -c "import ctypes; ctypes.CDLL('libcudart.so')" 2>/dev/null; then
  cudart=$(python -c "import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); \
print((sorted(glob.glob(d + '/nvidia/*/lib/libcudart.so.*')) + sorted(glob.glob(d + '/nvidia/*/*/lib/libcudart.so.*')) + [''])[0])")
  if [ -n "$cudart" ]; then
    mkdir -p /tmp/cudart && ln -sf "$cudart" /tmp/cudart/libcudart.so
    export LD_LIBRARY_PATH="/tmp/cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "libcudart.so -> $cudart"
  fi
fi
python - <<'PY' || true
import importlib
for name in ("fastsafetensors", "kvikio", "safetensors", "h5py"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - a report line, not a failure
        print(f"{name}: not importable ({type(e).__name__}: {e})")
from tensorstore_h5 import transfer
print("tensorstore_h5 loads to CUDA through", "GPUDirect Storage (kvikio)" if transfer._kvikio() is not None
      else "the pinned staging buffers (no GDS)")
PY
failed=0  # the benchmark runs even when a test fails; the script exits 1 when either failed
stage "CUDA tests"
python -m pytest -q -p no:cacheprovider -m cuda tests/ 2>&1 | tee "$out/gpu-tests.txt" || failed=1
stage "bench --gpu"
python -m tensorstore_h5.bench --gpu --only "${ONLY:-G.}" --size-gb "${SIZE_GB:-2}" --repeat "${REPEAT:-3}" \
  ${SETTLE:+--settle "$SETTLE"} --json "$out/gpu.json" 2>&1 | tee "$out/gpu.txt" || failed=1
# The first load in a fresh process, staging buffers pinned by cudaHostRegister (the default) and
# through torch's pin_memory; then the 6,000-tensor state's loads and where their time goes.
if [ "${PHASES:-1}" != 0 ]; then
  stage "phases"
  timeout 120 python bench/gpu_phases.py "${SIZE_GB:-2}" first:2x64 first:2x64/torch small 2>&1 \
    | tee "$out/gpu-phases.txt" || true
fi
stage "done"
exit "$failed"
