#!/usr/bin/env bash
# Builds detspec's CUDA wheel (abi3, Linux x86_64) on a machine with no GPU and no CUDA install:
# the CUDA 13.0 toolkit comes from PyPI wheels, link shims and a libcuda stub stand in for the
# driver at link time (scripts/cuda-env.sh). The stub is never shipped (`--auditwheel skip`): on
# the GPU machine the driver's libcuda.so.1 loads, and cuBLAS/cuRAND/NVRTC/cudart come from the
# CUDA 13 libraries torch 2.11 installs (site-packages/nvidia/cu13/lib, on the extension's
# RUNPATH; `pip install torch` first).
#
#   scripts/build-cuda-wheel.sh [out-dir]     # default dist-cuda/: the wheel and cuda_ops
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
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda}"
maturin build --release --features python,cuda --auditwheel skip -o "$out"
# The CUDA kernel table's test binary (tests/cuda_ops.rs), run on the GPU machine by
# scripts/gpu-session.sh (it finds cuBLAS through LD_LIBRARY_PATH there).
ops="$(cargo test --release --features cuda --test cuda_ops --no-run --message-format=json \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_ops":
        print(m["executable"])')"
# Compressed (44 MB -> 6 MB; the device call carries at most 64 MiB in all).
strip -o "$out/cuda_ops" "$ops"
xz -T0 -6 -f "$out/cuda_ops"
ls -l "$out"
