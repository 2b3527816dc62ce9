#!/usr/bin/env bash
# Run HERE (a machine with PyPI), before a lent GPU machine runs bench/gpu_check.sh: downloads the
# GPU peers that machine lacks into .whl/ (git-ignored), which the device call carries
# (carry: [".whl"]) and gpu_check.sh installs from, offline. The lent machines run Python 3.12
# and torch built for CUDA 13 (CU=12 for a CUDA 12 build). cupy, cuda-pathfinder, the cuFile
# library (nvidia-cufile) and typer, which these need, are already there.
set -euo pipefail
cd "$(dirname "$0")/.."
cu="${CU:-13}"
py="${PY_VERSION:-3.12}"
platforms=""
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms="$platforms --platform $p"
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp $platforms -d .whl \
  "fastsafetensors>=0.5" "kvikio-cu$cu" "libkvikio-cu$cu" "rapids-logger==0.3.*"
ls -la .whl
du -sh .whl
