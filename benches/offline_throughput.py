"""Offline throughput of one configuration, small enough to run under `perf record`.

N random 128-token prompts -> 64 greedy tokens each (``ignore_eos``) on the bench model of
docs/architecture.md (written to ``/tmp/benchmodel`` on first use), after a warm-up of the same size
(so the timed runs find the allocator and the KV pages already touched, as a server does);
prints output tokens per second and the process's CPU time per run. ``--runs R`` times R
batches of fresh prompts; ``--max-tokens 1`` times the prefill alone; ``--temperature T``
(and ``--top-p P``) sample with seed 0 instead of greedy decoding (RL rollouts, evals);
``--n K`` samples K completions of each prompt (a GRPO group), ``--prompt-len L`` sets the
prompt length, ``--deterministic`` makes every request deterministic. Extra ``key=value``
arguments go to ``LLM`` (integers and true/false parsed).

    python benches/offline_throughput.py 64
    python benches/offline_throughput.py 64 --runs 3 --max-tokens 1
    python benches/offline_throughput.py 64 max_num_batched_tokens=8192 enable_prefix_caching=false
    python benches/offline_throughput.py 64 --temperature 1.0
    python benches/offline_throughput.py 8 --n 8 --prompt-len 512 --max-tokens 32 --temperature 1.0
    perf record -F 999 -g python benches/offline_throughput.py 64
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from bench_model import bench_model

from detspec import LLM, SamplingParams


def main(argv: list[str]) -> None:
    model = str(bench_model(os.environ.get("DETSPEC_BENCH_MODEL", "/tmp/benchmodel"), "bench"))
    n = int(argv[0])
    runs, max_tokens, temperature, top_p = 1, 64, 0.0, 1.0
    samples, prompt_len, deterministic = 1, 128, False
    kw: dict[str, int | str | bool] = {}
    args = iter(argv[1:])
    for a in args:
        if a == "--runs":
            runs = int(next(args))
        elif a == "--max-tokens":
            max_tokens = int(next(args))
        elif a == "--temperature":
            temperature = float(next(args))
        elif a == "--top-p":
            top_p = float(next(args))
        elif a == "--n":
            samples = int(next(args))
        elif a == "--prompt-len":
            prompt_len = int(next(args))
        elif a == "--deterministic":
            deterministic = True
        else:
            k, v = a.split("=", 1)
            kw[k] = int(v) if v.isdigit() else {"true": True, "false": False}.get(v, v)
    llm = LLM(model, **kw)
    rng = np.random.default_rng(0)
    params = SamplingParams(
        n=samples,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=0,
        ignore_eos=True,
        deterministic=deterministic,
    )

    def batch() -> list[list[int]]:
        return [[int(x) for x in rng.integers(3, 30000, prompt_len)] for _ in range(n)]

    llm.generate(batch(), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    for r in range(runs):
        prompts = batch()
        c0, t = os.times(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt, c1 = time.perf_counter() - t, os.times()
        toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
        rate = (n * prompt_len / dt, "prompt") if max_tokens == 1 else (toks / dt, "output")
        print(
            f"run {r} n={n}x{samples} prompt={prompt_len} T={temperature} top_p={top_p} "
            f"det={deterministic} {kw} "
            f"{rate[0]:.1f} {rate[1]} tok/s ({dt:.2f}s; "
            f"user {c1.user - c0.user:.2f}s sys {c1.system - c0.system:.2f}s) "
            f"load={os.getloadavg()[0]:.2f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
