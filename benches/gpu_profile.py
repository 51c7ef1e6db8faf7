"""Where a decode step's GPU time goes: torch's profiler (CUPTI sees every kernel of the
process, detspec's and cuBLAS's included) around batch-1 and batch-64 greedy decode on a
model directory, printing the kernels by total GPU time and the host-side totals.

    python benches/gpu_profile.py --model-dir /tmp/llama3-8b-random
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--tokens", type=int, default=17)
    p.add_argument("--rows", type=int, default=18)
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from detspec import LLM, SamplingParams

    llm = LLM(
        str(args.model_dir),
        device="cuda",
        num_kv_pages=4096,
        enable_prefix_caching=False,
    )
    rng = np.random.default_rng(0)
    for n in [int(x) for x in args.batches.split(",")]:
        prompts = [[int(x) for x in rng.integers(3, 120000, 128)] for _ in range(n)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        # Prefill first, outside the profile: one step of prompt, then `tokens` decode steps.
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof_one:
            llm.generate(prompts, one, use_tqdm=False)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, many, use_tqdm=False)
        torch.cuda.synchronize()
        print(f"=== batch {n}: {args.tokens} tokens (first: prefill)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
        print(f"=== batch {n}: prefill + 1 token")
        print(prof_one.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    llm.shutdown()


if __name__ == "__main__":
    main()
