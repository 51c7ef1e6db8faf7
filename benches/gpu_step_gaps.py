"""Where a batch-1 decode step loses the GPU: a timeline of the GPU's work against the host's
CUDA calls (torch's profiler, CUPTI), measured per step, and batch-1 decode at several
``num_threads`` (the engine's host thread pool, which also runs the sampler).

Per step, from the trace: the GPU's busy time, its idle time inside the step, and the gap
between the logits' copy to the host (the step's end on the GPU) and the next step's first
kernel (the host sampling, scheduling and building the step meanwhile).

    python benches/gpu_step_gaps.py --model-dir /tmp/llama3-8b --out gaps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 1) if xs else float("nan")


def step_gaps(trace: dict) -> dict:
    """Per-step medians (µs) from a chrome trace of decode steps, each ending with one
    device-to-host copy of the logits."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    ends = [i for i, e in enumerate(gpu) if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]]
    rows: dict[str, list[float]] = {"step": [], "busy": [], "idle_inside": [], "between_steps": []}
    for a, b in zip(ends, ends[1:], strict=False):
        step = gpu[a + 1 : b + 1]
        if not step:
            continue
        copy_end = gpu[a]["ts"] + gpu[a]["dur"]
        first, last = step[0]["ts"], step[-1]["ts"] + step[-1]["dur"]
        busy = sum(e["dur"] for e in step)
        rows["step"].append(last - copy_end)
        rows["busy"].append(busy)
        rows["idle_inside"].append(last - first - busy)
        rows["between_steps"].append(first - copy_end)
    out: dict = {k: median(v) for k, v in rows.items()}
    out["steps"] = len(rows["step"])
    return out


def decode_rate(llm, vocab: int) -> float:
    from detspec import SamplingParams

    rng = np.random.default_rng(1)
    p = [[int(x) for x in rng.integers(3, vocab, 128)]]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True)
    # As gpu_bench.py's decode part: one untimed run first (a shape's first prefill pays for
    # cuBLAS's choice of kernels), then the median of three.
    llm.generate(p, one, use_tqdm=False)
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(p, one, use_tqdm=False)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(p, many, use_tqdm=False)
        rates.append(128 / (time.perf_counter() - t - t1))
    return round(statistics.median(rates), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--threads", default="0,1,4", help="num_threads values (0: the default)")
    p.add_argument("--tokens", type=int, default=33)
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from detspec import LLM, SamplingParams

    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    res: dict = {}
    for i, n in enumerate(int(x) for x in args.threads.split(",")):
        kw = {"num_threads": n} if n else {}
        # No prefix cache: the 129-token run must prefill the prompt as the 1-token run did, or
        # their difference leaves out a prefill (with the cache on, this script once read 196
        # tok/s on a wheel that gpu_bench.py, cache off, measured at ~167).
        llm = LLM(
            str(args.model_dir),
            device=args.device,
            num_kv_pages=1024,
            enable_prefix_caching=False,
            **kw,
        )
        res[f"decode_tok_s_threads_{n or 'default'}"] = decode_rate(llm, vocab)
        print(json.dumps(res), flush=True)
        if i == 0:
            rng = np.random.default_rng(0)
            prompt = [[int(x) for x in rng.integers(3, vocab, 128)]]
            params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
            activities = [ProfilerActivity.CPU]
            if args.device == "cuda":
                activities.append(ProfilerActivity.CUDA)
            with profile(activities=activities) as prof:
                llm.generate(prompt, params, use_tqdm=False)
            if args.device == "cuda":
                torch.cuda.synchronize()
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / "trace.json"
                prof.export_chrome_trace(str(path))
                res["batch1_step_us"] = step_gaps(json.loads(path.read_text()))
            print(json.dumps(res["batch1_step_us"]), flush=True)
        llm.shutdown()
        del llm
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
