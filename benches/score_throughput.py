"""Deterministic scoring throughput: ``prompt_logprobs`` and ``score`` of many prompts in one
call, the way an eval harness's loglikelihood requests reach the engine, on both CPU kernel
profiles (the invariant one, where any grouping gives the same bits, and the shape-dependent
one, where scoring runs in the shapes a deterministic generation ran at, as on a GPU), with a
plain ``generate`` of one token per prompt beside them for scale.

Two cases run with the prefix cache (emptied before every timed call), where scoring and
generation share the prompt's KV pages: ``eval_loglikelihood``, lm-eval's request to vLLM
(``prompt_logprobs=1`` with ``max_tokens=1``: the prompt logprobs are computed first and the
generation reads their pages), and ``score_after_generate``, an RL step's ``score`` of the
completions a deterministic ``generate`` just sampled (only the ``score`` is timed; it reads
the generated prompts' pages). A third, ``score_shared_prompts``, scores ``--group``
completions of each of a quarter of the prompts in one call (a GRPO group, DPO's pairs): the
first pair of each prompt computes it, the others read its pages.

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
    p.add_argument("--group", type=int, default=4, help="completions per shared prompt")
    p.add_argument("--cases", default=None, help="only these cases, comma-separated")
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
    shared = prompts[: max(1, len(prompts) // 4)]
    group_prompts = [p for p in shared for _ in range(args.group)]
    group_completions = [
        [int(x) for x in rng.integers(3, vocab, size=int(rng.integers(1, args.max_completion + 1)))]
        for _ in group_prompts
    ]
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    loglikelihood = SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1, deterministic=True
    )
    rollout = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=args.max_completion,
        ignore_eos=True,
        deterministic=True,
    )
    rows = []
    for profile in args.profiles.split(","):
        # No prefix cache: every timed call computes its prompts again.
        llm = LLM(str(model_dir), kernel_profile=profile, enable_prefix_caching=False)
        cached = LLM(str(model_dir), kernel_profile=profile)
        sampled: list[list[int]] = []

        def rollouts(llm: LLM = cached, sampled: list[list[int]] = sampled) -> None:
            llm.reset_prefix_cache()
            outs = llm.generate(prompts, rollout, use_tqdm=False)
            sampled[:] = [list(o.outputs[0].token_ids) for o in outs]

        # (engine, untimed set-up before each call, the timed call)
        cases = {
            "prompt_logprobs": (llm, None, lambda llm=llm: llm.prompt_logprobs(prompts, 1)),
            "score": (llm, None, lambda llm=llm: llm.score(prompts, completions)),
            "generate_1_token": (
                llm,
                None,
                lambda llm=llm: llm.generate(prompts, one_token, use_tqdm=False),
            ),
            "eval_loglikelihood": (
                cached,
                cached.reset_prefix_cache,
                lambda llm=cached: llm.generate(prompts, loglikelihood, use_tqdm=False),
            ),
            "score_after_generate": (
                cached,
                rollouts,
                lambda llm=cached, sampled=sampled: llm.score(prompts, sampled),
            ),
            "score_shared_prompts": (
                cached,
                cached.reset_prefix_cache,
                lambda llm=cached: llm.score(group_prompts, group_completions),
            ),
        }
        chosen = args.cases.split(",") if args.cases else list(cases)
        for name, (engine, prepare, run) in ((n, cases[n]) for n in chosen):
            times = []
            for i in range(args.repeats + 1):  # the first is a warm-up
                if prepare is not None:
                    prepare()
                hits = engine.kv_stats()["prefix_hits"]
                start = time.perf_counter()
                run()
                if i > 0:
                    times.append(time.perf_counter() - start)
                hits = engine.kv_stats()["prefix_hits"] - hits
            best = min(times)
            called = group_prompts if name == "score_shared_prompts" else prompts
            row_prompts = len(called)
            row = {
                "profile": profile,
                "fingerprint": llm.fingerprint,
                "case": name,
                "prompts": row_prompts,
                "prompt_tokens": sum(len(p) for p in called),
                "prefix_hit_tokens": int(hits),
                "best_s": round(best, 4),
                "prompts_per_s": round(row_prompts / best, 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        llm.shutdown()
        cached.shutdown()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
