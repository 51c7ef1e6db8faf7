# Sourced (not run) by scripts/build-cuda-wheel.sh and scripts/test.sh: sets up what building
# detspec's `cuda` feature needs on a machine with no GPU and no CUDA install, from PyPI and
# crates.io only (docs/cuda.md, "Build"):
#
# - the CUDA 13.0 toolkit (nvcc, headers, the libraries cudarc links) from PyPI's `cuda-toolkit`
#   wheels, pinned to 13.0.2 as torch 2.11 pins it: its PTX (ISA 9.0) is what driver 580 JITs;
# - link shims: the wheels ship only versioned libraries (libcublas.so.13), the linker wants
#   libcublas.so; and a stub libcuda.so (SONAME libcuda.so.1) defining every driver symbol cudarc
#   references, since the driver comes with the GPU. The stub is only linked against, never
#   shipped (the wheel is built with `--auditwheel skip`); at run time the real driver loads.
#
# Exports PATH, CUDA_HOME, CUDA_COMPUTE_CAP (90: H100/H200), CUDARC_CUDA_VERSION, CUDAFORGE_THREADS,
# DETSPEC_CUDA_LINK_DIR (build.rs adds it to the link search path).
#
# DETSPEC_CUDA_VENV overrides where the toolkit venv lives (default ~/.cache/detspec/cuda-toolkit-venv);
# DETSPEC_CUDA_LINK_ONLY_HEADERS=1 skips the libraries (enough for `cargo check`).

_detspec_cuda_setup() {
    local venv="${DETSPEC_CUDA_VENV:-$HOME/.cache/detspec/cuda-toolkit-venv}"
    local extras="nvcc,crt,nvvm,cccl,cudart"
    if [ "${DETSPEC_CUDA_LINK_ONLY_HEADERS:-0}" != 1 ]; then
        extras="$extras,cublas,curand,nvrtc"
    fi
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || return 1
    fi
    "$venv/bin/python" -m pip install -q "cuda-toolkit[$extras]==13.0.2" || return 1
    local cu
    cu="$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))')" \
        || return 1
    if [ ! -x "$cu/bin/nvcc" ]; then
        echo "cuda-env: no nvcc under $cu" >&2
        return 1
    fi

    local link="$venv/detspec-link"
    mkdir -p "$link"
    if [ "${DETSPEC_CUDA_LINK_ONLY_HEADERS:-0}" != 1 ]; then
        local lib
        for lib in cudart.so.13 cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13; do
            ln -sf "$cu/lib/lib$lib" "$link/lib${lib%%.so*}.so"
        done
        if [ ! -f "$link/libcuda.so" ]; then
            local sys
            sys="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs \
                2>/dev/null | head -n1 || true)"
            if [ -z "$sys" ]; then
                cargo fetch -q || return 1
                sys="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs \
                    | head -n1)"
            fi
            grep -oP '^\s+(pub )?fn \Kcu[A-Za-z0-9_]+(?=\()' "$sys" | sort -u \
                | sed 's/.*/int &(void){return 999;}/' >"$link/cuda_stub.c"
            gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/cuda_stub.c" \
                || return 1
        fi
    fi

    export PATH="$cu/bin:$PATH"
    export CUDA_HOME="$cu"
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
    export CUDARC_CUDA_VERSION=13000
    export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
    export DETSPEC_CUDA_LINK_DIR="$link"
}

_detspec_cuda_setup
