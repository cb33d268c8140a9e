#!/usr/bin/env bash
# Wheels for the GPU check's host (scripts/gpu_check.sh): the packages splitinfer needs that the host's
# image lacks, as manylinux x86-64 wheels for its Python (3.12), into .gpu-wheels/ (gitignored; carry it).
#
#   scripts/gpu_wheels.sh [DIR]        (on a machine that reaches the package registry)
#
# The host has torch, transformers, safetensors, tokenizers, numpy, prometheus-client and tqdm
# (/work/.library/device/KINDS.md lists its image); websockets is the one core dependency it lacks. The
# version is this environment's (or WEBSOCKETS_VERSION), so the check runs the code the tests ran.
set -eu -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$ROOT/.gpu-wheels}
PYTHON=${PYTHON:-python3}
VERSION=${WEBSOCKETS_VERSION:-$("$PYTHON" -c "import websockets; print(websockets.__version__)")}
mkdir -p "$DIR"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DIR" "websockets==$VERSION"
ls -l "$DIR"
du -sh "$DIR"
