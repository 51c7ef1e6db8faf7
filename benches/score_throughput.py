"""Deterministic scoring throughput: ``prompt_logprobs`` and ``score`` of many prompts in one
call, the way an eval harness's loglikelihood requests reach the engine, on both CPU kernel
profiles (the invariant one, where any grouping gives the same bits, and the shape-dependent
one, where scoring runs in the shapes a deterministic generation ran at, as on a GPU), with a
plain ``generate`` of one token per prompt beside them for scale.

    python benches/score_throughput.py                         # bench model, ~1 min on 2 cores
    python benches/score_throughput.py --prompts 64 --model tiny
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["bench", "tiny"], default="bench")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--max-completion", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--profiles", default="invariant,shape_dependent", help="kernel profiles, comma-separated"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from bench_model import bench_model, vocab_size

    from detspec import LLM, SamplingParams

    model_dir = bench_model(args.model_dir, args.model)
    vocab = vocab_size(model_dir)
    rng = np.random.default_rng(0)
    lens = rng.integers(args.min_len, args.max_len + 1, size=args.prompts)
    prompts = [[int(x) for x in rng.integers(3, vocab, size=int(n))] for n in lens]
    completions = [
        [int(x) for x in rng.integers(3, vocab, size=int(rng.integers(1, args.max_completion + 1)))]
        for _ in prompts
    ]
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for profile in args.profiles.split(","):
        # No prefix cache: every timed call computes its prompts again.
        llm = LLM(str(model_dir), kernel_profile=profile, enable_prefix_caching=False)
        cases = {
            "prompt_logprobs": lambda llm=llm: llm.prompt_logprobs(prompts, 1),
            "score": lambda llm=llm: llm.score(prompts, completions),
            "generate_1_token": lambda llm=llm: llm.generate(prompts, one_token, use_tqdm=False),
        }
        for name, run in cases.items():
            run()  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            best = min(times)
            row = {
                "profile": profile,
                "fingerprint": llm.fingerprint,
                "case": name,
                "prompts": len(prompts),
                "prompt_tokens": int(lens.sum()),
                "best_s": round(best, 4),
                "prompts_per_s": round(len(prompts) / best, 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        llm.shutdown()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
