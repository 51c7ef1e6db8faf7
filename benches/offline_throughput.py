"""Offline throughput of one configuration, small enough to run under `perf record`.

N random 128-token prompts -> 64 greedy tokens each (``ignore_eos``) on the bench model of
DESIGN.md §11 (written to ``/tmp/benchmodel`` on first use), after a short warm-up; prints
output tokens per second. Extra ``key=value`` arguments go to ``LLM`` (integers parsed).

    python benches/offline_throughput.py 64
    python benches/offline_throughput.py 64 max_num_batched_tokens=8192
    perf record -F 999 -g python benches/offline_throughput.py 64
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from detspec import LLM, SamplingParams, _core


def main(argv: list[str]) -> None:
    model = os.environ.get("DETSPEC_BENCH_MODEL", "/tmp/benchmodel")
    if not os.path.exists(os.path.join(model, "config.json")):
        _core.write_demo_model(model, "bench", 0)
    kw: dict[str, int | str] = {}
    for a in argv[1:]:
        k, v = a.split("=", 1)
        kw[k] = int(v) if v.isdigit() else v
    llm = LLM(model, **kw)
    n = int(argv[0])
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 30000, 128)] for _ in range(n)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"n={n} {kw} {toks / dt:.1f} tok/s ({dt:.2f}s) load={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
