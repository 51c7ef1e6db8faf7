"""DVR stress run: one 200-request trace replayed under different arrival orders and
concurrency levels; every ``deterministic=True`` request must come back bit for bit the same.

The trace (fixed numpy seed) mixes prompt lengths 1..200 tokens, ``max_tokens`` 1..64,
greedy / seeded temperature-0.8 / seeded top-p (0.9, temperature 0.8) sampling, a few
requests with repetition/frequency penalties or stop token ids (so finishes can happen on a
speculative path that is then rolled back), and exactly half of the requests
``deterministic=True``. Every sampled request has a seed, deterministic or not, so the
non-deterministic ones can only differ through the batch-variant fast path: the count of
non-deterministic requests that differ across runs is the sanity signal that the runs did
batch differently (it is expected to be > 0).

Scenarios (all with the same ``verify_window`` / ``verify_group``, so the same fingerprint):

* ``a-trace-order``   ``LLM.generate`` of the whole trace at once, in trace order.
* ``b-reversed``      ``LLM.generate`` in reversed order, with ``fault_injection`` (default
                      0.25) forcing rollbacks in a share of the verify windows.
* ``c-async-shuffled`` ``AsyncLLM``: a random shuffled order, random 0..``--max-delay-ms``
                      pauses between submissions (requests join mid-decode),
                      ``max_num_seqs=32``, ``verify_finish_wait=--finish-wait``.
* ``d-chunked-preempt`` ``max_num_seqs=4``, ``max_num_batched_tokens=48`` (chunked prefill
                      of the non-deterministic prompts; deterministic prompts are prefilled
                      alone, unchunked, by design) and a small KV pool (``--small-kv-pages``)
                      forcing preemption and recompute; ``verify_finish_wait`` as in c.

For every deterministic request the token ids, each token's logprob (compared as the bits of
the float), its rank, the cumulative logprob (bits), the finish reason and the fingerprint
must be identical in every completed scenario. Exit status: 0 all identical, 1 a
deterministic mismatch (printed), 2 the time limit stopped the run before two scenarios
completed, 3 a scenario raised.

    python benches/dvr_stress.py                    # tiny model, ~1 min on 2 cores
    python benches/dvr_stress.py --model bench --time-limit 420
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "bench"], default="tiny")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the model is (written there if missing); default: a temporary directory",
    )
    p.add_argument(
        "--kernel-profile",
        default="invariant",
        choices=["invariant", "shape_dependent"],
        help="CPU GEMM profile; shape_dependent is the replay test profile, whose rollbacks "
        "happen by themselves",
    )
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--max-prompt-len", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--det-share", type=float, default=0.5, help="share of deterministic requests")
    p.add_argument("--seed", type=int, default=0, help="numpy seed of the trace")
    p.add_argument("--verify-window", type=int, default=16)
    p.add_argument("--verify-group", type=int, default=4)
    p.add_argument(
        "--verify-strategy",
        choices=["auto", "replay", "inline"],
        default="auto",
        help="DVR strategy of every scenario (auto: inline on CPU)",
    )
    p.add_argument(
        "--fault-injection",
        type=float,
        default=0.25,
        help="forced-mismatch share of verify windows in scenario b (0 to disable)",
    )
    p.add_argument(
        "--finish-wait",
        type=int,
        default=8,
        help="verify_finish_wait of scenarios c and d (steps a finished deterministic request "
        "may wait for a fuller verify group; not part of the fingerprint)",
    )
    p.add_argument("--max-delay-ms", type=float, default=20.0, help="scenario c pauses")
    p.add_argument(
        "--small-kv-pages",
        type=int,
        default=None,
        help="KV pool of scenario d in pages (default: 1.5 x the longest request's pages "
        "+ the reserved verify pages, small enough to preempt with 4 sequences)",
    )
    p.add_argument(
        "--scenarios",
        type=str,
        default="a,b,c,d",
        help="comma-separated subset of a,b,c,d, in the order to run them",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=300.0,
        help="seconds; a scenario still running then is cut and the completed ones compared",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights and KV cache (bfloat16: the demo model rounded at load, bf16 KV cache)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- trace


def build_trace(args: argparse.Namespace, vocab: int) -> list[dict]:
    """The requests: prompt ids and sampling settings, a pure function of ``args.seed``."""
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    det = np.zeros(n, dtype=bool)
    det[rng.permutation(n)[: int(round(args.det_share * n))]] = True
    trace = []
    for i in range(n):
        plen = int(rng.integers(1, args.max_prompt_len + 1))
        prompt = [int(t) for t in rng.integers(2, vocab, size=plen)]
        kind = ["greedy", "temp0.8", "top_p0.9"][int(rng.integers(0, 3))]
        sp: dict = {
            "max_tokens": int(rng.integers(1, args.max_tokens + 1)),
            "logprobs": 0,
            "deterministic": bool(det[i]),
            "seed": int(rng.integers(0, 2**31)),
        }
        if kind == "greedy":
            sp["temperature"] = 0.0
        else:
            sp["temperature"] = 0.8
            if kind == "top_p0.9":
                sp["top_p"] = 0.9
        extra = float(rng.random())
        if extra < 0.15:
            kind += "+penalties"
            sp["repetition_penalty"] = 1.1
            sp["frequency_penalty"] = 0.3
        elif extra < 0.35:
            kind += "+stop_ids"
            sp["stop_token_ids"] = [int(t) for t in rng.integers(2, vocab, size=8)]
        trace.append({"index": i, "prompt": prompt, "params": sp, "kind": kind})
    return trace


def sampling_params(entry: dict):
    from detspec import SamplingParams

    return SamplingParams(**entry["params"])


# --------------------------------------------------------------------------- results


def float_bits(x: float | None) -> str | None:
    return None if x is None else struct.pack("<d", float(x)).hex()


def record(out) -> dict:
    """What must be identical for a deterministic request, with floats as their bits."""
    c = out.outputs[0]
    lps, ranks = [], []
    for tok, d in zip(c.token_ids, c.logprobs or [], strict=False):
        lp = d[tok]
        lps.append(float_bits(lp.logprob))
        ranks.append(lp.rank)
    return {
        "token_ids": list(c.token_ids),
        "logprob_bits": lps,
        "ranks": ranks,
        "cumulative_logprob_bits": float_bits(c.cumulative_logprob),
        "finish_reason": c.finish_reason,
        "fingerprint": out.fingerprint,
        "num_logprobs": len(c.logprobs or []),
        "metrics": {
            k: out.metrics.get(k)
            for k in ("num_verify_passes", "num_rollbacks", "num_rolled_back_tokens")
        },
    }


def core_mtime() -> str:
    """When the loaded engine library was installed (the wheel can change between runs)."""
    from detspec import _core

    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(os.stat(_core.__file__).st_mtime))


def engine_kwargs(args: argparse.Namespace, **over) -> dict:
    kw = {
        "determinism": "dvr",
        "verify_window": args.verify_window,
        "verify_group": args.verify_group,
        "verify_strategy": args.verify_strategy,
        "kernel_profile": args.kernel_profile,
        "dtype": args.dtype,
    }
    kw.update(over)
    return kw


def run_offline(model_dir: str, trace: list[dict], order: list[int], kw: dict) -> tuple:
    from detspec import LLM

    llm = LLM(model_dir, **kw)
    try:
        prompts = [trace[i]["prompt"] for i in order]
        params = [sampling_params(trace[i]) for i in order]
        outs = llm.generate(prompts, params, use_tqdm=False)
        results = {order[j]: record(o) for j, o in enumerate(outs)}
        return results, llm.stats()
    finally:
        llm.shutdown()


def run_async(
    model_dir: str, trace: list[dict], order: list[int], delays: list[float], kw: dict
) -> tuple:
    from detspec import AsyncLLM

    engine = AsyncLLM(model_dir, **kw)
    results: dict[int, dict] = {}

    async def one(i: int) -> None:
        last = None
        async for out in engine.generate(
            trace[i]["prompt"], sampling_params(trace[i]), request_id=f"r{i}"
        ):
            last = out
        results[i] = record(last)

    async def main() -> None:
        tasks = []
        for i, delay in zip(order, delays, strict=True):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(delay)
        await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
        return results, engine.stats()
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- compare


def compare(trace: list[dict], runs: dict[str, dict[int, dict]]) -> tuple[list, list, list]:
    """(deterministic mismatches, non-deterministic requests differing in any way,
    non-deterministic requests differing in token ids)."""
    names = list(runs)
    keys = (
        "token_ids",
        "logprob_bits",
        "ranks",
        "cumulative_logprob_bits",
        "finish_reason",
        "fingerprint",
        "num_logprobs",
    )
    det_bad, nondet_any, nondet_tokens = [], [], []
    for e in trace:
        i = e["index"]
        ref_name = names[0]
        ref = runs[ref_name][i]
        for name in names[1:]:
            got = runs[name][i]
            diff = [k for k in keys if got[k] != ref[k]]
            if not diff:
                continue
            if e["params"]["deterministic"]:
                det_bad.append((i, ref_name, name, diff, first_difference(ref, got)))
            else:
                if i not in nondet_any:
                    nondet_any.append(i)
                if "token_ids" in diff and i not in nondet_tokens:
                    nondet_tokens.append(i)
    return det_bad, nondet_any, nondet_tokens


def first_difference(a: dict, b: dict) -> str:
    for k in ("token_ids", "logprob_bits", "ranks"):
        for j, (x, y) in enumerate(zip(a[k], b[k], strict=False)):
            if x != y:
                return f"{k}[{j}]: {x} vs {y}"
        if len(a[k]) != len(b[k]):
            return f"len({k}): {len(a[k])} vs {len(b[k])}"
    for k in ("cumulative_logprob_bits", "finish_reason", "fingerprint"):
        if a[k] != b[k]:
            return f"{k}: {a[k]} vs {b[k]}"
    return "?"


# --------------------------------------------------------------------------- main


_STATE = {"cut": False}  # a scenario cut by the time limit still runs in its thread


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.time_limit

    from bench_model import bench_model, vocab_size

    args.model_dir = bench_model(args.model_dir, args.model)
    model_dir = str(args.model_dir)
    vocab = vocab_size(model_dir)

    trace = build_trace(args, vocab)
    n = len(trace)
    n_det = sum(e["params"]["deterministic"] for e in trace)
    page_size = 16
    longest = max(len(e["prompt"]) + e["params"]["max_tokens"] for e in trace)
    longest_pages = -(-longest // page_size)
    # DVR reserves one page per dummy verify row group; leave them room on top.
    small_pages = args.small_kv_pages or (longest_pages * 3) // 2 + args.verify_group + 2

    rnd = random.Random(args.seed + 1)
    shuffled = list(range(n))
    rnd.shuffle(shuffled)
    delays = [rnd.uniform(0.0, args.max_delay_ms / 1000.0) for _ in range(n)]

    scenarios = {
        "a-trace-order": lambda: run_offline(model_dir, trace, list(range(n)), engine_kwargs(args)),
        "b-reversed": lambda: run_offline(
            model_dir,
            trace,
            list(reversed(range(n))),
            engine_kwargs(args, fault_injection=args.fault_injection),
        ),
        "c-async-shuffled": lambda: run_async(
            model_dir,
            trace,
            shuffled,
            delays,
            engine_kwargs(args, max_num_seqs=32, verify_finish_wait=args.finish_wait),
        ),
        "d-chunked-preempt": lambda: run_offline(
            model_dir,
            trace,
            list(range(n)),
            engine_kwargs(
                args,
                max_num_seqs=4,
                max_num_batched_tokens=48,
                num_kv_pages=small_pages,
                page_size=page_size,
                verify_finish_wait=args.finish_wait,
            ),
        ),
    }
    wanted = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    scenarios = {k: v for k, v in scenarios.items() if k.split("-")[0] in wanted}
    order = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    scenarios = dict(sorted(scenarios.items(), key=lambda kv: order.index(kv[0].split("-")[0])))

    print(
        f"trace: {n} requests ({n_det} deterministic), prompts 1..{args.max_prompt_len}, "
        f"max_tokens 1..{args.max_tokens}, seed {args.seed}; model {args.model} "
        f"(vocab {vocab}); W={args.verify_window} B={args.verify_group}; "
        f"scenario d KV pool {small_pages} pages of {page_size}; detspec core installed "
        f"{core_mtime()} UTC",
        flush=True,
    )
    runs: dict[str, dict[int, dict]] = {}
    summary: dict = {"scenarios": {}}
    stopped_early = None
    for name, fn in scenarios.items():
        if time.monotonic() >= deadline - 1.0:
            stopped_early = name
            print(f"time limit: {name} and later scenarios not run", flush=True)
            break
        box: dict = {}

        def work(fn=fn, box=box) -> None:
            try:
                box["value"] = fn()
            except BaseException as err:  # reported below
                box["error"] = err

        t0 = time.monotonic()
        worker = threading.Thread(target=work, name=f"scenario-{name}", daemon=True)
        worker.start()
        worker.join(timeout=max(deadline - time.monotonic(), 0.0))
        if worker.is_alive():
            stopped_early = name
            _STATE["cut"] = True
            print(
                f"time limit: {name} cut after {time.monotonic() - t0:.0f} s; "
                "comparing the scenarios that completed",
                flush=True,
            )
            break
        if "error" in box:  # an engine error is a finding: report it and stop
            exc = box["error"]
            print(f"{name}: raised {type(exc).__name__}: {exc}", flush=True)
            summary["error"] = f"{name}: {type(exc).__name__}: {exc}"
            if args.out:
                args.out.write_text(json.dumps(summary, indent=2))
            return 3
        results, stats = box["value"]
        last_duration = time.monotonic() - t0
        runs[name] = results
        out_tokens = sum(len(r["token_ids"]) for r in results.values())
        # A request's share of a verify pass is one "window"; fault injection and rollbacks
        # count windows, the engine's num_verify_passes counts B-request passes.
        windows = sum(r["metrics"]["num_verify_passes"] or 0 for r in results.values())
        summary["scenarios"][name] = {
            "wall_s": last_duration,
            "output_tokens": out_tokens,
            "verify_windows": windows,
            **stats,
        }
        print(
            f"{name:18s} {last_duration:6.1f} s  {out_tokens:5d} output tokens  "
            f"verify passes {stats['num_verify_passes']:4d} (windows {windows:4d})  "
            f"rollbacks {stats['num_rollbacks']:3d} "
            f"(rolled-back tokens {stats['num_rolled_back_tokens']:4d})  padded rows "
            f"{stats['num_padded_rows']:5d}  preemptions {stats['num_preemptions']:3d}",
            flush=True,
        )

    if len(runs) < 2:
        print("fewer than two scenarios completed: nothing to compare", flush=True)
        return 2
    det_bad, nondet_any, nondet_tokens = compare(trace, runs)
    det_tokens = sum(
        len(runs[next(iter(runs))][e["index"]]["token_ids"])
        for e in trace
        if e["params"]["deterministic"]
    )
    kinds: dict[str, int] = {}
    for e in trace:
        if e["params"]["deterministic"]:
            k = e["kind"].split("+")[0]
            kinds[k] = kinds.get(k, 0) + 1
    summary.update(
        {
            "requests": n,
            "detspec_core_installed_utc": core_mtime(),
            "deterministic": n_det,
            "deterministic_output_tokens": det_tokens,
            "deterministic_kinds": kinds,
            "scenarios_compared": list(runs),
            "stopped_early_at": stopped_early,
            "deterministic_mismatches": [
                {"index": i, "ref": a, "other": b, "fields": d, "first": f}
                for i, a, b, d, f in det_bad
            ],
            "nondeterministic_differing_any": len(nondet_any),
            "nondeterministic_differing_tokens": len(nondet_tokens),
            "wall_s": time.monotonic() - t_start,
        }
    )
    print()
    print(f"compared {len(runs)} of {len(scenarios)} scenarios: {', '.join(runs)}")
    print(
        f"deterministic requests: {n_det} ({det_tokens} output tokens per run; "
        f"{', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}); "
        f"mismatching: {len({i for i, *_ in det_bad})}"
    )
    print(
        f"non-deterministic requests: {n - n_det}; differing across runs at all (ids or "
        f"logprob bits): {len(nondet_any)}; in token ids: {len(nondet_tokens)}"
    )
    tot = {
        k: sum(s[k] for s in summary["scenarios"].values())
        for k in ("num_verify_passes", "num_rollbacks", "num_rolled_back_tokens", "num_preemptions")
    }
    print(
        f"totals over the runs: verify passes {tot['num_verify_passes']}, rollbacks "
        f"{tot['num_rollbacks']} (rolled-back tokens {tot['num_rolled_back_tokens']}), "
        f"preemptions {tot['num_preemptions']}; wall {summary['wall_s']:.1f} s"
    )
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    if det_bad:
        print("\nDETERMINISTIC MISMATCHES:")
        for i, a, b, d, f in det_bad[:20]:
            e = trace[i]
            print(
                f"  request {i} ({e['kind']}, prompt {len(e['prompt'])} tokens, "
                f"max_tokens {e['params']['max_tokens']}): {a} vs {b}: fields {d}; first: {f}"
            )
        return 1
    if not nondet_any:
        print(
            "warning: no non-deterministic request differed: "
            "the runs may not have batched differently"
        )
    print("OK: every deterministic request is bitwise identical across the runs")
    return 0


if __name__ == "__main__":
    code = main()
    if _STATE["cut"]:  # do not wait for the engine thread of the cut scenario
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
