#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the Python 3.12 manylinux x86_64 wheels that the GPU
# machine lacks (see /work/.library/device/README.md, nvidia-h200 notes). That machine has
# grpcio 1.84, protobuf 7.36, numpy, uvloop, xxhash, prometheus-client, pytest, torch 2.11,
# cupy 14.2 and cuda-bindings 13.3 already; scripts/gpu-check.sh installs what is here.
#
#     scripts/fetch-gpu-wheels.sh        # then: device run with carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=${PYTHON:-python3}
fetch() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
    -d .whl "$@"
}
# grpcio-health-checking and -reflection are pure Python; pin them to the machine's grpcio.
fetch "grpcio-health-checking==1.84.0" "grpcio-reflection==1.84.0" "lmdb==1.7.5"
ls -l .whl
