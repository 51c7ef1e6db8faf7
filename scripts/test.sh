#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh machine and runs all tests:
# Rust unit + integration tests, then the Python suite against the freshly built wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null || { echo "cargo not found: install Rust (rustup) first" >&2; exit 1; }
python3 -m pip install -q --upgrade "maturin>=1.7,<2"
python3 -m pip install -q "numpy>=1.26" "tqdm>=4.60" "pytest>=8" "pytest-asyncio>=0.23" \
    "hypothesis>=6" "torch>=2.2" "transformers>=4.45" "tokenizers>=0.20" "safetensors>=0.4" \
    "peft>=0.13"
# the server extra (detspec[serve]) and what its tests drive it with
python3 -m pip install -q "fastapi>=0.110" "uvicorn>=0.30" "prometheus-client>=0.20" "pydantic>=2.5" \
    "httpx>=0.27" "openai>=1.40" "schemathesis>=4.0" "trustme>=1.1"
# lm-evaluation-harness, driven against `detspec serve` by tests/python/test_lm_eval.py
python3 -m pip install -q "lm-eval[api]>=0.4.13"
# the Ray extra (detspec[ray]): ~20 s from a warm pip cache, see docs/scaling.md
python3 -m pip install -q "ray[serve]>=2.60"

# The extension in release (the Python tests run real models), then the Rust tests in the same
# profile so the dependency builds are shared: `cargo test` recompiles only the dev-dependencies
# and detspec itself (Cargo.toml's feature-unification entries keep every shared crate's features
# the same in both builds; without them it rebuilt ~40 dependencies, candle included).
rm -rf dist
maturin build --release -o dist
python3 -m pip install -q --force-reinstall --no-deps dist/detspec-*.whl
cargo test --release

# The CUDA backend still compiles, here without a GPU: `cargo check --features cuda` runs build.rs,
# which compiles cuda/*.cu to PTX with the toolkit from PyPI (scripts/cuda-env.sh; headers and nvcc
# only, no libraries: nothing links). candle's own kernels are a pinned release that
# scripts/build-cuda-wheel.sh compiles for real; here scripts/nvcc-check writes empty outputs for
# them (they were 630 of this step's 854 s from nothing). In the release profile the step reuses
# the build scripts and proc macros built above: ~100 s in all. The GPU tests themselves are
# tests/gpu/, run on a GPU machine with the CUDA wheel.
(
    export DETSPEC_CUDA_LINK_ONLY_HEADERS=1
    # shellcheck source=scripts/cuda-env.sh
    source scripts/cuda-env.sh
    NVCC="$PWD/scripts/nvcc-check" cargo check --release --features cuda,python --all-targets
)

set +e
python3 -m pytest -q tests/python -m "not ray"
rc=$?
# The Ray tests start a local Ray cluster (1-3 min in all): their own process, so Ray's
# workers and threads never share one with the other tests.
python3 -m pytest -q tests/python -m ray
rc_ray=$?
set -e
if [ "$rc" -eq 5 ] || [ "$rc_ray" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
exit "$rc_ray"
