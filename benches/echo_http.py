"""lm-eval's loglikelihood requests over HTTP: ``/v1/completions`` with ``echo``,
``max_tokens: 1`` and ``logprobs: 1`` (what ``local-completions`` sends), ``--concurrency``
at a time, against a ``detspec serve`` this script starts on the bench model. Prints requests
per second and the prompt tokens the generations read from the prefix cache (the scoring
forward runs first and leaves the prompt's pages for the generation).

    python benches/echo_http.py --model-dir /tmp/benchmodel
    python benches/echo_http.py --model-dir DIR --deterministic --requests 96
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
from serve_process import free_port, wait_ready


async def run(url: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, int]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(prompt: list[int]) -> dict:
            body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1,
                    "temperature": 0, "deterministic": args.deterministic}  # fmt: skip
            async with gate:
                r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise SystemExit(f"{r.status_code} {r.text}")
            return r.json()

        await asyncio.gather(*(one(p) for p in prompts[: args.concurrency]))  # warm-up
        start = time.perf_counter()
        res = await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - start
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                 for r in res)  # fmt: skip
    return dt, cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--deterministic", action="store_true")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "detspec", "serve", args.model_dir, "--port", str(port),
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
           "--max-model-len", str(max(2048, args.prompt_len + 16))]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url)
        rng = np.random.default_rng(0)
        prompts = [
            [int(x) for x in rng.integers(3, 30000, args.prompt_len)] for _ in range(args.requests)
        ]
        dt, cached = asyncio.run(run(url, prompts, args))
    finally:
        proc.terminate()
        proc.wait()
    print(json.dumps({
        "deterministic": args.deterministic, "requests": args.requests,
        "prompt_len": args.prompt_len, "concurrency": args.concurrency, "s": round(dt, 3),
        "requests_per_s": round(args.requests / dt, 2), "cached_prompt_tokens": cached,
        "load_avg": os.getloadavg()[0],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
