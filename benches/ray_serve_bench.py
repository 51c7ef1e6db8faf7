"""Ray Serve against ``detspec serve`` on one machine, with ``detspec bench serve``'s load
generator (streamed completions over real HTTP):

* per-request overhead: one request at a time (concurrency 1), short outputs, through Ray's
  proxy with one replica against ``detspec serve`` directly; the e2e latency difference is
  what Ray's proxy, router and replica hop cost;
* paired overhead: the same, but alternating one request to ``detspec serve`` and one through
  Ray (both up at once), so that whatever else loads the machine loads both sides alike; the
  median of the per-pair differences is the figure to quote on a shared machine;
* throughput: many concurrent clients against ``detspec serve``, Ray with one replica (all
  cores) and Ray with two replicas (the cores split between them).

The load average is recorded before and after each run: the machine may be shared, and on a
2-core machine two replicas cannot beat one replica on all cores by much.

    python benches/ray_serve_bench.py --out bench_ray.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
from bench_model import bench_model
from serve_process import bench_args, free_port, wait_ready

from detspec.bench import run_benchmark


def bench(url: str, label: str, **kw: Any) -> dict[str, Any]:
    args = bench_args(base_url=url, label=label, **kw)
    load_before = list(os.getloadavg())
    result = asyncio.run(run_benchmark(args))
    result["loadavg_before"] = load_before
    print(
        f"{label:<34} req/s {result['request_throughput']:7.2f}  out tok/s "
        f"{result['output_throughput']:8.1f}  e2e p50 {result['p50_e2el_ms']:7.2f} ms  "
        f"failed {result['failed']}  load {load_before[0]:.2f}->{result['loadavg_after'][0]:.2f}",
        flush=True,
    )
    return result


def workloads(url: str, prefix: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = [
        bench(
            url,
            f"{prefix} overhead c=1 out={n}",
            num_prompts=args.overhead_requests,
            max_concurrency=1,
            random_input_len=16,
            random_output_len=n,
            vocab_size=256,
        )
        for n in (1, 16)
    ]
    out.append(
        bench(
            url,
            f"{prefix} throughput c={args.concurrency}",
            num_prompts=args.num_prompts,
            max_concurrency=args.concurrency,
            random_input_len=64,
            random_output_len=64,
            deterministic_fraction=args.deterministic_fraction,
            vocab_size=256,
        )
    )
    return out


def start_direct(model: str, threads: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "detspec", "serve", model, "--port", str(port)]
    cmd += ["--num-threads", str(threads), "--disable-uvicorn-access-log"]
    cmd += ["--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    return proc, url


def paired_overhead(direct: str, ray_url: str, n: int) -> dict[str, Any]:
    """Alternates one non-streamed 1-token request to each; e2e seconds per side."""
    body = {"model": "", "prompt": list(range(3, 19)), "max_tokens": 1, "temperature": 0.0}
    times: dict[str, list[float]] = {"direct": [], "ray": []}
    load_before = list(os.getloadavg())
    with httpx.Client(timeout=60) as c:
        names = {u: c.get(u + "/v1/models").json()["data"][0]["id"] for u in (direct, ray_url)}
        for i in range(n + 10):
            for side, url in (("direct", direct), ("ray", ray_url))[:: 1 if i % 2 else -1]:
                t = time.perf_counter()
                r = c.post(url + "/v1/completions", json={**body, "model": names[url]})
                dt = time.perf_counter() - t
                assert r.status_code == 200, r.text
                if i >= 10:  # warm-up
                    times[side].append(dt)
    diffs = sorted(r - d for r, d in zip(times["ray"], times["direct"], strict=True))
    med = {k: sorted(v)[len(v) // 2] * 1000 for k, v in times.items()}
    out = {
        "label": "paired overhead c=1 out=1 (non-streamed)",
        "pairs": n,
        "p50_direct_ms": med["direct"],
        "p50_ray_ms": med["ray"],
        "p50_pair_diff_ms": diffs[len(diffs) // 2] * 1000,
        "p10_pair_diff_ms": diffs[len(diffs) // 10] * 1000,
        "p90_pair_diff_ms": diffs[(9 * len(diffs)) // 10] * 1000,
        "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
    }
    print(
        f"paired overhead: p50 direct {med['direct']:.2f} ms, ray {med['ray']:.2f} ms, "
        f"p50 difference {out['p50_pair_diff_ms']:.2f} ms "
        f"(p10 {out['p10_pair_diff_ms']:.2f}, p90 {out['p90_pair_diff_ms']:.2f})  "
        f"load {load_before[0]:.2f}->{out['loadavg_after'][0]:.2f}",
        flush=True,
    )
    return out


def run_ray(model: str, direct_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import ray
    from ray import serve

    from detspec.ray import build_app

    ray.init(
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        object_store_memory=200 * 1024**2,
        log_to_driver=False,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    cores = os.cpu_count() or 1
    results: list[dict[str, Any]] = []
    try:
        for replicas, threads in args.ray_configs:
            serve.run(
                build_app(
                    model=model,
                    num_replicas=replicas,
                    num_cpus=cores / replicas,
                    num_threads=threads,
                ),
                name="detspec",
                route_prefix="/",
            )
            wait_ready(url)
            results += workloads(url, f"ray replicas={replicas} threads={threads}", args)
            if replicas == 1:
                results.append(paired_overhead(direct_url, url, args.overhead_requests))
            serve.delete("detspec")
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the 'bench' demo model)")
    p.add_argument("--overhead-requests", type=int, default=100)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--deterministic-fraction", type=float, default=0.0)
    p.add_argument("--out", default=None, help="write all results as JSON here")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    # (replicas, engine threads per replica): one replica on every core; two that split them.
    args.ray_configs = [(1, cores), (2, max(1, cores // 2))]
    model = str(bench_model(args.model, "bench"))
    proc, direct_url = start_direct(model, cores)
    try:
        results = workloads(direct_url, f"direct threads={cores}", args)
        results += run_ray(model, direct_url, args)
    finally:
        proc.terminate()
        proc.wait(30)
    meta = {"cpu_count": cores, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
