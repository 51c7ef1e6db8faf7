#!/usr/bin/env bash
# GPU work for one device call (a machine with CUDA 13 driver, Python 3.12 + torch 2.11+cu130,
# no Rust, no package index). Build on the CPU machine first and carry `dist-cuda/`:
#
#   scripts/build-cuda-wheel.sh        # -> dist-cuda/detspec-*.whl and dist-cuda/cuda_ops.xz
#   # device run, carry ["dist-cuda"]:
#   scripts/gpu-session.sh [PHASE ...]   # phases: smoke ops tests bench profile dvr_peaked
#                                        #   dvr_groups gaps lora decode_ab memutil
#                                        # (default: smoke ops tests bench)
#
# smoke: installs the wheel (no dependencies: torch and its CUDA 13 libraries are there),
#        checks the extension loads the driver and cuBLAS, generates on a tiny model in f32 and
#        bf16, runs a prompt longer than the token budget (its first chunk samples no row), and
#        sizes a KV pool with gpu_memory_utilization.
# ops:   the CUDA kernel table (tests/cuda_ops.rs, built as dist-cuda/cuda_ops.xz): KERNEL-TABLE lines.
# tests: tests/gpu (pytest; pytest-timeout bounds each test).
# bench: writes a Llama-3.1-8B-shaped bf16 model, runs benches/gpu_bench.py.
# profile: the same model's decode steps at batch 1 and 64 under torch's profiler (CUPTI: every
#        kernel of the process, cuBLAS's included), benches/gpu_profile.py -> $OUT/profile.txt.
# dvr_peaked: the DVR parts of gpu_bench.py on an 8B-shaped model with planted, confident
#        successors and 10 % choice points (write_random_llama.py --peaked): DVR's cost where the
#        fast path and the verifier rarely disagree, as on a trained model (random weights roll
#        back every ~13 deterministic tokens) -> $OUT/gpu_bench_peaked.json.
# dvr_groups: the DVR part on the random 8B-shaped model with verify_group B = 1, 2, 4 (the
#        bench phase's dvr rows are B = 8): which B a pass's cost favours on this GPU
#        -> $OUT/gpu_bench_groups.json.
# gaps:  batch-1 decode steps on the peaked 8B-shaped model against the GPU's timeline, and at
#        num_threads 16/1/4 (benches/gpu_step_gaps.py) -> $OUT/gaps.json.
# lora:  what rank-16 adapters on all projections cost on the peaked 8B-shaped model at batch
#        1/16/64 (benches/lora_throughput.py) -> $OUT/lora.log.
# decode_ab: batch-1 decode of the peaked 8B-shaped model with a baseline wheel
#        (dist-cuda-base/, carried too) and this one, alternating, two rounds each; one JSON
#        line per run in the log (a change's speed measured side by side on one GPU).
# memutil: the peaked 8B-shaped model with gpu_memory_utilization $DETSPEC_GPU_UTILIZATION
#        (default 0.9) instead of a fixed pool, through batch 64 (greedy and sampled: the
#        host sampler's cost) and DVR at 0/100 %: what the pool got, what the GPU holds with
#        the engine alive, no out-of-memory -> $OUT/gpu_bench_memutil.json.
#
# Each phase runs under its own time limit (DETSPEC_GPU_<PHASE>_S seconds) and a failing phase
# does not stop the next. Everything printed lands in $OUT (or /tmp/detspec-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/detspec-gpu}"
mkdir -p "$out"
exec > >(tee -a "$out/gpu-session.log") 2>&1
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(smoke ops tests bench)
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
cu13="$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')"
export LD_LIBRARY_PATH="$cu13:${LD_LIBRARY_PATH:-}"
python3 -m pip install -q --no-index --no-deps --force-reinstall dist-cuda/detspec-*.whl \
    || { echo "wheel install failed"; exit 1; }

limit() { local v="DETSPEC_GPU_${1^^}_S"; echo "${!v:-$2}"; }

run_smoke() {
    python3 - <<'PY'
import tempfile, time
import detspec
from detspec import _core, LLM, SamplingParams
print("CUDA build:", detspec.built_with_cuda(), "GPUs:", _core.cuda_device_count())
assert detspec.cuda_available(), "the CUDA wheel cannot open a GPU here"
d = tempfile.mkdtemp()
_core.write_demo_model(d, "tiny", 5)
for dtype in ("float32", "bfloat16"):
    t = time.perf_counter()
    llm = LLM(d, device="cuda", dtype=dtype, num_kv_pages=512, max_num_batched_tokens=128)
    print(dtype, "loaded in", round(time.perf_counter() - t, 2), "s:", llm.fingerprint)
    for det in (False, True):
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, deterministic=det, seed=1, ignore_eos=True))
        print(" ", "det" if det else "fast", out[0].outputs[0].token_ids)
        long = llm.generate([list(range(3, 1003))], SamplingParams(max_tokens=4, deterministic=det, seed=1, ignore_eos=True))
        print("  long prompt:", long[0].outputs[0].token_ids)
    print(" ", llm.stats())
    llm.shutdown()
# vLLM's gpu_memory_utilization sizes the KV pool from the GPU's memory (untested before this).
llm = LLM(d, device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=128)
free, total = llm.kv_pages()
print("gpu_memory_utilization 0.3: KV pages", total, "(free", free, ")")
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))
print(" ", out[0].outputs[0].token_ids)
llm.shutdown()
PY
}

run_decode_ab() {
    local model wheel
    model="$(peaked_model)"
    for round in 1 2; do
        for wheel in dist-cuda-base dist-cuda; do
            # Each wheel in its own directory, put first on the path: the installed one stays.
            [ -d "/tmp/$wheel" ] || python3 -m pip install -q --no-index --no-deps \
                --target "/tmp/$wheel" "$wheel"/detspec-*.whl || { echo "no wheel in $wheel"; return 1; }
            PYTHONPATH="/tmp/$wheel" python3 benches/gpu_bench.py --model-dir "$model" \
                --parts bandwidth,decode --out "/tmp/decode-$wheel-$round.json" > /dev/null
            python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
print("DECODE", sys.argv[2], sys.argv[3], json.dumps({k: d[k] for k in ("decode_batch1", "engine")}))' \
                "/tmp/decode-$wheel-$round.json" "$wheel" "$round"
        done
    done
}

run_memutil() {
    python3 benches/gpu_bench.py --model-dir "$(peaked_model)" --out "$out/gpu_bench_memutil.json" \
        --gpu-memory-utilization "${DETSPEC_GPU_UTILIZATION:-0.9}" --parts offline,sampled,dvr \
        --batches 64 --shares 0,100
}

run_ops() {
    python3 -c 'import lzma, shutil
with lzma.open("dist-cuda/cuda_ops.xz") as src, open("/tmp/cuda_ops", "wb") as dst:
    shutil.copyfileobj(src, dst)' || { echo "no dist-cuda/cuda_ops.xz"; return 1; }
    chmod +x /tmp/cuda_ops
    # DETSPEC_GPU_OPS_FILTER: run only the tests whose names contain it.
    /tmp/cuda_ops ${DETSPEC_GPU_OPS_FILTER:-} --nocapture --test-threads=1 | tee "$out/kernel-table.log"
}

run_tests() {
    python3 -m pytest -q -s tests/gpu -p no:cacheprovider --timeout 150 \
        --junitxml="$out/gpu-tests.xml"
}

run_bench() {
    local model=/tmp/llama3-8b-random
    [ -f "$model/config.json" ] || python3 benches/write_random_llama.py --shape llama3-8b --out "$model"
    python3 benches/gpu_bench.py --model-dir "$model" --out "$out/gpu_bench.json" \
        ${DETSPEC_GPU_BENCH_PARTS:+--parts "$DETSPEC_GPU_BENCH_PARTS"}
}

run_profile() {
    local model=/tmp/llama3-8b-random
    [ -f "$model/config.json" ] || python3 benches/write_random_llama.py --shape llama3-8b --out "$model"
    python3 benches/gpu_profile.py --model-dir "$model" > "$out/profile.txt" 2>&1
    grep -v '^-' "$out/profile.txt" | cut -c1-60,100-230 | head -60
}

run_dvr_peaked() {
    python3 benches/gpu_bench.py --model-dir "$(peaked_model)" --out "$out/gpu_bench_peaked.json" \
        --parts "${DETSPEC_GPU_PEAKED_PARTS:-dvr,dvr_adaptive}"
}

run_dvr_groups() {
    local model=/tmp/llama3-8b-random
    [ -f "$model/config.json" ] || python3 benches/write_random_llama.py --shape llama3-8b --out "$model"
    python3 benches/gpu_bench.py --model-dir "$model" --out "$out/gpu_bench_groups.json" \
        --parts dvr_groups --groups "${DETSPEC_GPU_GROUPS:-1,2,4}"
}

peaked_model() {
    local model=/tmp/llama3-8b-peaked
    [ -f "$model/config.json" ] || python3 benches/write_random_llama.py --shape llama3-8b \
        --peaked --choice-fraction 0.1 --out "$model" >&2
    echo "$model"
}

run_gaps() {
    python3 benches/gpu_step_gaps.py --model-dir "$(peaked_model)" --out "$out/gaps.json"
}

run_lora() {
    DETSPEC_BENCH_MODEL="$(peaked_model)" python3 benches/lora_throughput.py 1 16 64 --rank 16 \
        --rounds 2 device=cuda dtype=bfloat16 | tee "$out/lora.log"
}

declare -A default_s=([smoke]=60 [ops]=120 [tests]=240 [bench]=300 [profile]=120 [dvr_peaked]=240
    [dvr_groups]=300 [gaps]=120 [lora]=150 [decode_ab]=150 [memutil]=120)
for phase in "${phases[@]}"; do
    s="$(limit "$phase" "${default_s[$phase]:-300}")"
    echo "=== $phase (limit ${s}s) $(date +%T)"
    start=$SECONDS
    # Functions run in a subshell under `timeout` through `bash -c` of this script's functions.
    timeout --kill-after=10 "$s" bash -c "$(declare -f peaked_model run_"$phase"); out='$out'; run_$phase"
    echo "=== $phase rc=$? in $((SECONDS - start))s"
done
