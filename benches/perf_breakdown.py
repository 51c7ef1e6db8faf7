"""Group a `perf record` profile of detspec into the rows of docs/performance.md.

perf record -F 999 -g -o new.data python benches/offline_throughput.py 64
python benches/perf_breakdown.py old.data new.data      # one column per profile
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys


def cats(path: str) -> collections.Counter:
    out = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            path,
            "--no-children",
            "--sort",
            "symbol",
            "--stdio",
            "-g",
            "none",
        ],
        capture_output=True,
        text=True,
    ).stdout
    b = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+\[(.)\]\s+(.*)", line)
        if not m:
            continue
        pct, kind, sym = float(m.group(1)), m.group(2), m.group(3).strip()
        s = sym
        if "gemm" in s:
            c = "GEMM"
        elif "paged_attention" in s:
            c = "attention"
        elif any(x in s for x in ["elementwise::", "rms_norm::", "rope::", "__expf"]):
            # __expf: SwiGLU's exp until kernel version 3 (libm's expf)
            c = "elementwise, rms_norm, rope"
        elif (
            "BarrierGuard" in s
            or "BarrierPool" in s
            or "binary_map" in s
            or "unary_map" in s
            or "call_trampoline" in s
        ):
            c = "candle elementwise pool"
        elif any(
            x in s
            for x in [
                "sampler",
                "exp",
                "log_sum_exp",
                "argmax",
                "top_n",
                "__ieee754",
                "__math",
                "__expf",
                "gumbel",
            ]
        ):
            c = "sampler (softmax, argmax)"
        elif kind == "k" or any(
            x in s for x in ["memmove", "memset", "copy_strided", "_PyObject", "malloc", "free"]
        ):
            c = "copies, allocation, page faults, kernel"
        elif any(x in s for x in ["rayon", "sched_yield", "futex", "blas_thread", "backtrace"]):
            c = "threading (rayon/OpenBLAS idle, hand-offs)"
        else:
            c = "other (Python, engine loop, closures, ...)"
        b[c] += pct
    return b


ORDER = [
    "GEMM",
    "attention",
    "elementwise, rms_norm, rope",
    "candle elementwise pool",
    "sampler (softmax, argmax)",
    "copies, allocation, page faults, kernel",
    "threading (rayon/OpenBLAS idle, hand-offs)",
    "other (Python, engine loop, closures, ...)",
]


def main(files: list[str]) -> None:
    res = [cats(f) for f in files]
    print("| share of samples | " + " | ".join(files) + " |")
    print("|---|" + "---:|" * len(files))
    for c in ORDER:
        print(f"| {c} | " + " | ".join(f"{r[c]:.1f} %" for r in res) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
