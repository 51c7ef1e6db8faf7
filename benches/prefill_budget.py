"""Chunked-prefill budget vs latency: what `max_num_batched_tokens` should default to.

64 requests arrive at once (bench model of docs/architecture.md, 128-token random prompts, 64 greedy
output tokens, ``ignore_eos``) on ``AsyncLLM``; for each token budget the engine is run twice
(rounds alternate over the budgets) and the script reports output throughput, time to first
token (p50 / p90 / max) and inter-token latency (p50 / p90 / max, gaps between a request's
streamed snapshots divided by the tokens they carried) measured in the asyncio consumer.
A large budget prefills every prompt in the first step (TTFT = the whole batch's prefill); a
small one interleaves prefill chunks with the running decodes.

    python benches/prefill_budget.py --out prefill-budget.json
    python benches/prefill_budget.py --budgets 8192,512 --rounds 1     # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=None, help="default: bench model in a tmp dir")
    p.add_argument("--budgets", default="8192,2048,1024,512,256")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


async def run_once(model_dir: str, budget: int, prompts: list[list[int]], out_len: int) -> dict:
    from detspec import AsyncLLM, SamplingParams

    engine = AsyncLLM(model_dir, max_num_batched_tokens=budget, max_num_seqs=256)
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    itl: list[float] = []

    async def one(i: int, p: list[int], t0: float) -> int:
        last_t, last_n = t0, 0
        async for out in engine.generate(p, params, request_id=f"r{i}"):
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if last_n == 0 and n > 0:
                ttft.append(now - t0)
            elif n > last_n:
                itl.extend([(now - last_t) / (n - last_n)] * (n - last_n))
            last_t, last_n = now, n
        return last_n

    try:
        # warm-up: one short request
        async for _ in engine.generate(prompts[0][:8], SamplingParams(max_tokens=2), "warm"):
            pass
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p, t0) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - t0
    finally:
        engine.shutdown()
    return {
        "budget": budget,
        "output_tok_s": sum(counts) / elapsed,
        "elapsed_s": elapsed,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "ttft_max_s": max(ttft),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p90_ms": 1e3 * pct(itl, 90),
        "itl_max_ms": 1e3 * max(itl),
        "loadavg": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench_model import bench_model

    args.model_dir = bench_model(args.model_dir, "bench")
    rng = np.random.default_rng(0)
    prompts = [
        [int(x) for x in rng.integers(3, 30000, args.prompt_len)] for _ in range(args.requests)
    ]
    budgets = [int(b) for b in args.budgets.split(",")]
    runs: list[dict] = []
    for r in range(args.rounds):
        order = budgets if r % 2 == 0 else list(reversed(budgets))
        for b in order:
            res = asyncio.run(run_once(str(args.model_dir), b, prompts, args.output_len))
            res["round"] = r
            runs.append(res)
            print(
                f"round {r} budget {b:5d}: {res['output_tok_s']:7.1f} tok/s  "
                f"TTFT p50/p90/max {res['ttft_p50_s']:.2f}/{res['ttft_p90_s']:.2f}/"
                f"{res['ttft_max_s']:.2f} s  ITL p50/p90/max {res['itl_p50_ms']:.0f}/"
                f"{res['itl_p90_ms']:.0f}/{res['itl_max_ms']:.0f} ms  load {res['loadavg']:.2f}",
                flush=True,
            )
    print("\n| budget | tok/s | TTFT p50 | TTFT p90 | TTFT max | ITL p50 | ITL p90 | ITL max |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in budgets:
        rs = [x for x in runs if x["budget"] == b]

        def med(k: str, rs: list[dict] = rs) -> float:
            return float(np.median([x[k] for x in rs]))

        print(
            f"| {b} | {med('output_tok_s'):.0f} | {med('ttft_p50_s'):.2f} s | "
            f"{med('ttft_p90_s'):.2f} s | {med('ttft_max_s'):.2f} s | {med('itl_p50_ms'):.0f} ms | "
            f"{med('itl_p90_ms'):.0f} ms | {med('itl_max_ms'):.0f} ms |"
        )
    if args.out:
        meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"args": meta, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
