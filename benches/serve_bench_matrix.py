"""The server benchmark of docs/performance.md: ``detspec bench serve`` against a local
``detspec serve`` and the same workload on an in-process ``AsyncLLM`` (what HTTP costs), at
0 % and 50 % deterministic traffic, over a range of concurrencies; writes the JSON results and
a PNG of latency percentiles against load (matplotlib, needed only here).

    python benches/serve_bench_matrix.py --out-dir /tmp/serve-bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_model import bench_model
from serve_process import bench_args, free_port, wait_ready

from detspec.bench import run_benchmark


def median_rows(results: list[dict]) -> list[dict]:
    """Per (backend, deterministic share, concurrency): the median over rounds of every
    numeric field."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        key = (r["backend"], r["deterministic_fraction"], r["max_concurrency"])
        groups.setdefault(key, []).append(r)
    rows = []
    for (backend, det, conc), rs in sorted(groups.items()):
        row: dict = {
            "backend": backend,
            "deterministic_fraction": det,
            "max_concurrency": conc,
            "rounds": len(rs),
        }
        for k, v in rs[0].items():
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in row:
                row[k] = statistics.median(x[k] for x in rs)
        row["loadavg_1m_range"] = [
            min(x["loadavg_before"][0] for x in rs),
            max(x["loadavg_after"][0] for x in rs),
        ]
        rows.append(row)
    return rows


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "end-to-end")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    styles = {
        ("openai", 0.0): ("tab:blue", "-"),
        ("openai", 0.5): ("tab:blue", "--"),
        ("inprocess", 0.0): ("tab:orange", "-"),
        ("inprocess", 0.5): ("tab:orange", "--"),
    }
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for (backend, det), (color, ls) in styles.items():
            rows = sorted(
                (
                    r
                    for r in results
                    if r["backend"] == backend and r["deterministic_fraction"] == det
                ),
                key=lambda r: r["max_concurrency"],
            )
            if not rows:
                continue
            x = [r["max_concurrency"] for r in rows]
            name = "HTTP server" if backend == "openai" else "in-process AsyncLLM"
            for q, marker in (("p50", "o"), ("p99", "^")):
                ax.plot(
                    x,
                    [r[f"{q}_{key}_ms"] for r in rows],
                    color=color,
                    ls=ls,
                    marker=marker,
                    alpha=1.0 if q == "p50" else 0.6,
                    label=f"{name}, {int(det * 100)}% det, {q}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("ms")
        ax.set_title(f"{title} (p50 o, p99 ^)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("detspec serve vs in-process AsyncLLM (tiny demo model, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model dir (default: the built-in tiny model)")
    ap.add_argument("--out-dir", default="serve-bench")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--det", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-client", type=int, default=4)
    ap.add_argument("--min-prompts", type=int, default=32)
    ap.add_argument(
        "--rounds", type=int, default=1, help="repeat the matrix; the plot shows medians"
    )
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Default: the random tiny model the docs' numbers were measured on (not the shipped one).
    model = str(bench_model(args.model, "tiny"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "detspec", "serve", model, "--port", str(port),
         "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    results = []
    try:
        wait_ready(base)
        common = dict(
            base_url=base,
            model_dir=model,
            random_input_len=args.input_len,
            random_output_len=args.output_len,
            random_range_ratio=0.5,
            temperature=0.8,
            vocab_size=900,
        )
        for backend in ("openai", "inprocess"):  # warm-up
            asyncio.run(run_benchmark(bench_args(backend=backend, num_prompts=8, **common)))
        for rnd, det, conc in (
            (r, d, c) for r in range(args.rounds) for d in args.det for c in args.concurrency
        ):
            for backend in ("openai", "inprocess"):
                n = max(args.min_prompts, args.prompts_per_client * conc)
                load_before = os.getloadavg()
                r = asyncio.run(
                    run_benchmark(
                        bench_args(
                            backend=backend,
                            num_prompts=n,
                            max_concurrency=conc,
                            deterministic_fraction=det,
                            label=f"{backend} c={conc} det={det} round={rnd}",
                            seed=rnd,
                            **common,
                        )
                    )
                )
                r["loadavg_before"] = list(load_before)
                r["round"] = rnd
                results.append(r)
                print(
                    f"{backend:9s} det={det:.1f} c={conc:3d}: "
                    f"{r['request_throughput']:.1f} req/s {r['output_throughput']:.0f} tok/s "
                    f"TTFT p50 {r['p50_ttft_ms']:.1f} p99 {r['p99_ttft_ms']:.1f} ms, "
                    f"TPOT p50 {r['p50_tpot_ms']:.2f} ms, e2e p99 {r['p99_e2el_ms']:.0f} ms, "
                    f"load {load_before[0]:.2f}->{r['loadavg_after'][0]:.2f}, "
                    f"failed {r['failed']}",
                    flush=True,
                )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    medians = median_rows(results)
    (out / "medians.json").write_text(json.dumps(medians, indent=2) + "\n")
    plot(medians, out / "serve_latency_vs_load.png")
    print(f"wrote {out / 'results.json'} and {out / 'serve_latency_vs_load.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
