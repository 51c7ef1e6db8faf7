//! With the `cuda` feature: compiles `cuda/*.cu` to PTX (embedded by `src/ops/cuda.rs`) and tells
//! the linker where the CUDA libraries are. Without it: nothing.
//!
//! Environment (scripts/cuda-env.sh sets all of it on a machine with no GPU):
//! - `NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on PATH;
//! - `CUDA_COMPUTE_CAP` (default 90: H100/H200): PTX for `compute_<cap>`, which the driver JITs
//!   for that GPU and newer ones;
//! - `DETSPEC_CUDA_LINK_DIR`: extra link search path (the link shims and libcuda stub).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build_cuda();
    }
}

fn build_cuda() {
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_COMPUTE_CAP",
        "DETSPEC_CUDA_LINK_DIR",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=cuda");
    let nvcc = env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| env::var_os("CUDA_HOME").map(|h| Path::new(&h).join("bin/nvcc")))
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".to_string());
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));

    let mut sources: Vec<PathBuf> = std::fs::read_dir("cuda")
        .expect("cuda/ holds the kernel sources")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    for src in &sources {
        let stem = src
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 file name");
        let ptx = out.join(format!("{stem}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-std=c++17", "-O3", "-Icuda"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-o")
            .arg(&ptx)
            .arg(src)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {} ({e}): install the CUDA toolkit or `source scripts/cuda-env.sh`",
                    nvcc.display()
                )
            });
        assert!(status.success(), "nvcc failed on {}", src.display());
    }

    if let Some(dir) = env::var_os("DETSPEC_CUDA_LINK_DIR") {
        println!(
            "cargo:rustc-link-search=native={}",
            Path::new(&dir).display()
        );
    }
    // The wheel's extension lives in site-packages/detspec/; torch's CUDA 13 libraries (cuBLAS,
    // cuRAND, NVRTC, cudart) in site-packages/nvidia/cu13/lib. The driver comes from the system.
    println!("cargo:rustc-link-arg-cdylib=-Wl,-rpath,$ORIGIN/../nvidia/cu13/lib");
}
