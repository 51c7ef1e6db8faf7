#!/usr/bin/env bash
# Builds detspec's CUDA wheel (abi3, Linux x86_64) on a machine with no GPU and no CUDA install:
# the CUDA 13.0 toolkit comes from PyPI wheels, link shims and a libcuda stub stand in for the
# driver at link time (scripts/cuda-env.sh). The stub is never shipped (`--auditwheel skip`): on
# the GPU machine the driver's libcuda.so.1 loads, and cuBLAS/cuRAND/NVRTC/cudart come from the
# CUDA 13 libraries torch 2.11 installs (site-packages/nvidia/cu13/lib, on the extension's
# RUNPATH; `pip install torch` first).
#
#   scripts/build-cuda-wheel.sh [out-dir]     # default dist-cuda/
#
# Kernels are compiled to PTX for compute capability $CUDA_COMPUTE_CAP (default 90: H100/H200),
# which the driver JITs for that GPU and newer ones.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-dist-cuda}"

command -v cargo >/dev/null || { echo "cargo not found: install Rust (rustup) first" >&2; exit 1; }
python3 -m pip install -q --upgrade "maturin>=1.7,<2"
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh

rm -rf "$out"
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda}" \
    maturin build --release --features python,cuda --auditwheel skip -o "$out"
ls "$out"/detspec-*.whl
