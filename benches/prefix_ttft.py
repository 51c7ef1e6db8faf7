"""Time to first token of a deterministic request whose 2,000-token prefix another
deterministic request already prefilled, with and without the deterministic prefix cache, on
both CPU kernel profiles (inline on the invariant one, replay on the shape-dependent one).

Per configuration: one engine; a deterministic request with prompt PREFIX + A runs first (it
prefills the prefix and caches its pages), then the timed request PREFIX + B, one output
token (its first token is the prefill's). With ``enable_prefix_caching=False`` the timed
request prefills the whole prompt again. The timed request's token and logprob bits must be
the same either way (the script checks).

    python benches/prefix_ttft.py                 # bench model, ~2 min on 2 cores
    python benches/prefix_ttft.py --prefix-len 500 --model tiny
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import time
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["bench", "tiny"], default="bench")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from bench_model import bench_model, vocab_size

    from detspec import LLM, SamplingParams

    model_dir = bench_model(args.model_dir, args.model)
    vocab = vocab_size(model_dir)
    rng = np.random.default_rng(0)
    prefix = [int(x) for x in rng.integers(3, vocab, size=args.prefix_len)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, deterministic=True)
    rows = []
    for profile, strategy in (("invariant", "inline"), ("shape_dependent", "replay")):
        first_bits = None
        for cache in (True, False):
            times = []
            for r in range(args.repeats):
                llm = LLM(
                    str(model_dir),
                    kernel_profile=profile,
                    verify_strategy=strategy,
                    enable_prefix_caching=cache,
                    max_num_batched_tokens=4096,
                )
                a = [int(x) for x in rng.integers(3, vocab, size=args.suffix_len)]
                b = [int(x) for x in np.random.default_rng(r).integers(3, vocab, args.suffix_len)]
                llm.generate([prefix + a], sp, use_tqdm=False)
                t0 = time.perf_counter()
                out = llm.generate([prefix + b], sp, use_tqdm=False)[0]
                times.append(time.perf_counter() - t0)
                c = out.outputs[0]
                got = (c.token_ids[0], struct.pack("<f", c.logprobs[0][c.token_ids[0]].logprob))
                if r == 0:
                    if first_bits is None:
                        first_bits = got
                    assert got == first_bits, f"{profile}: cached and uncached bits differ"
                stats = llm.kv_stats()
                llm.shutdown()
            rows.append(
                {
                    "profile": profile,
                    "strategy": strategy,
                    "prefix_cache": cache,
                    "ttft_s_median": float(np.median(times)),
                    "ttft_s_all": times,
                    "prefix_hit_rate": stats["hit_rate"],
                }
            )
            print(
                f"{profile:16s} {strategy:7s} prefix cache {'on ' if cache else 'off'}  "
                f"TTFT median {np.median(times) * 1000:8.1f} ms  "
                f"(runs {', '.join(f'{t * 1000:.0f}' for t in times)})  "
                f"hit rate {stats['hit_rate']:.2f}",
                flush=True,
            )
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "rows": rows,
                    "args": vars(args) | {"out": str(args.out), "model_dir": str(args.model_dir)},
                    "load": load,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
