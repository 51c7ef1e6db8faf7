#!/usr/bin/env bash
# One device call's worth of GPU work (the `device` tool's machine: CUDA 13.0 driver, Python 3.12
# with torch 2.11+cu130, no Rust). Build the wheel here first and carry it:
#
#   scripts/build-cuda-wheel.sh            # -> dist-cuda/detspec-*.whl (on the CPU machine)
#   # device run, carry ["dist-cuda"]:
#   scripts/gpu-session.sh [tests|bench|all]   # default: tests
#
# Installs the wheel (no dependencies: torch and the CUDA 13 libraries are already there),
# checks that the extension finds the driver and torch's CUDA libraries, runs tests/gpu, and
# (bench, all) the GPU benchmarks on a random Llama-3.1-8B-shaped bf16 model. Everything it
# prints also lands under $OUT (when set) for the note.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-tests}"
out="${OUT:-/tmp/detspec-gpu}"
mkdir -p "$out"
exec > >(tee -a "$out/gpu-session.log") 2>&1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -m pip install -q --no-deps --force-reinstall dist-cuda/detspec-*.whl
python3 -m pip install -q "pytest>=8" "pytest-asyncio>=0.23" "transformers>=4.45" \
    "tokenizers>=0.20" "safetensors>=0.4" "numpy>=1.26" "tqdm>=4.60" 2>/dev/null || true
python3 - <<'PY'
import detspec
from detspec import _core
print("CUDA build:", detspec.built_with_cuda(), "GPUs:", _core.cuda_device_count())
assert detspec.cuda_available(), "the CUDA wheel cannot open a GPU here"
PY

if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest -q -s tests/gpu -p no:cacheprovider --junitxml="$out/gpu-tests.xml" || true
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
    model=/tmp/llama3-8b-random
    [ -f "$model/config.json" ] || python3 benches/write_random_llama.py --shape llama3-8b --out "$model"
    for n in 1 16 64 256; do
        DETSPEC_BENCH_MODEL=$model python3 benches/offline_throughput.py "$n" device=cuda \
            num_kv_pages=16384 max_num_batched_tokens=8192 | tee -a "$out/throughput.txt"
    done
    python3 benches/dvr_throughput.py --model-dir "$model" --device cuda --parts offline \
        --num-requests 128 --out "$out/dvr_share.json" || true
fi
