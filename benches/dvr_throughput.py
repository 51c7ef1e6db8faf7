"""Throughput cost of decode-verify-rollback (DVR) at mixed deterministic traffic.

Measures, on the benchmark model of docs/architecture.md (``write_demo_model(dir, "bench", 0)``:
Llama-shaped, random weights, hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408,
vocab 32000; ``--model tiny`` for a smoke run), in one process and side by side:

* ``offline``: every request submitted at once (``LLM.generate``). Output-token throughput of
  ``determinism="dvr"`` at 0, 2, 10, 50, 100 % ``deterministic=True`` requests, relative to
  0 % (the 0 % row runs first and again last in every round; the reference is the median
  of all those runs and their spread is printed as a noise indicator);
  ``determinism="batch_invariant"`` (every request invariant, so 100 %); the no-batching
  baseline (``max_num_seqs=1``, mode ``off``: one request at a time, deterministic because
  nothing is ever batched); and DVR at 50 % with
  ``--fault-injection`` of the verify windows forced to roll back (real rollbacks are rare
  with random weights, so this row shows what recompute costs).
* ``poisson``: the same configurations with requests submitted by ``AsyncLLM`` at Poisson
  arrival times (fixed seed) for each of two fixed rates (``--rates``, requests/s; ``auto``
  = 0.5x and 1.0x the request throughput of the 0 % offline run measured at the start of
  this part). Throughput = output tokens / (last finish - first submission); also mean
  time to first token and end-to-end latency seen by the client.
* ``--finish-wait N`` adds DVR rows at 50 and 100 % where a deterministic request that
  finished on the fast path may wait up to N steps for a fuller verify group
  (``verify_finish_wait``).
* ``sweep``: DVR at 50 % deterministic traffic, offline, for W in ``--sweep-windows`` x B in
  ``--sweep-groups``, relative to a 0 % run in the same part.

Besides wall-clock throughput every row gives output tokens per CPU-second of the process
(all threads, ``time.process_time``), steadier than wall time on a shared machine. Each row
also gives the engine counters over that run: verify passes, rollbacks per verify
pass and per verified window (a request's share of one pass), rolled-back tokens as a share
of output tokens (the recomputed-token share), and padded verify rows per output token.

With ``--repeats R`` every part runs R rounds over its rows (interleaved, so a slow drift of
a shared machine hits every row alike); a row reports the median of its runs' throughput and
latencies (the mean for R = 2), and the counters of its first run.

All requests use ``ignore_eos=True`` so every configuration produces exactly the same number
of output tokens; sampling is greedy unless ``--temperature`` > 0 (then seeded). Speed is a
measurement, never a test: this prints Markdown tables and writes JSON (``--out``).

    python benches/dvr_throughput.py --parts offline --out dvr-offline.json
    python benches/dvr_throughput.py --parts poisson --out dvr-poisson.json
    python benches/dvr_throughput.py --parts sweep --quick --out dvr-sweep.json
    python benches/dvr_throughput.py --model tiny --quick            # smoke, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def int_range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(",")
    return int(lo), int(hi or lo)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["bench", "tiny", "bench-moe", "tiny-moe"], default="bench")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the model is (written there if missing); default: a temporary directory",
    )
    p.add_argument(
        "--parts", type=str, default="offline,poisson,sweep", help="any of offline,poisson,sweep"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (the CUDA wheel)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument(
        "--kernel-profile",
        default="invariant",
        choices=["invariant", "shape_dependent"],
        help="CPU GEMM profile; shape_dependent is the replay test profile (auto = replay)",
    )
    p.add_argument("--num-requests", type=int, default=50)
    p.add_argument("--prompt-len", type=int_range, default=(32, 128), help="min,max (uniform)")
    p.add_argument("--output-len", type=int_range, default=(32, 64), help="min,max (uniform)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--det-shares", type=int_list, default=[0, 2, 10, 50, 100], help="percent")
    p.add_argument(
        "--replay-shares",
        type=int_list,
        default=[50, 100],
        help="percent deterministic of the rows with verify_strategy='replay'",
    )
    p.add_argument("--verify-window", type=int, default=64, help="W of the offline/poisson rows")
    p.add_argument("--verify-group", type=int, default=8, help="B of the offline/poisson rows")
    p.add_argument(
        "--fault-injection",
        type=float,
        default=0.1,
        help="share of verify windows forced to roll back in the extra 50 %% row (0: no row)",
    )
    p.add_argument(
        "--finish-wait",
        type=int,
        default=0,
        help="also run DVR at 50 %% and 100 %% with verify_finish_wait=N (steps a finished "
        "deterministic request may wait for a fuller verify group; 0: no such rows)",
    )
    p.add_argument(
        "--baselines",
        type=str,
        default="batch_invariant,no_batching",
        help="comma-separated baselines to run (batch_invariant, no_batching; '' for none)",
    )
    p.add_argument(
        "--rates",
        type=str,
        default="auto",
        help="two Poisson rates in requests/s, e.g. '1.0,2.0'; 'auto': 0.5x and 1.0x the 0 %% "
        "offline request throughput measured at the start of the poisson part",
    )
    p.add_argument("--poisson-requests", type=int, default=None, help="default: --num-requests")
    p.add_argument(
        "--prefix-caching",
        choices=["off", "on"],
        default="off",
        help="the engine's prefix cache (where the installed detspec has one). Off by default: "
        "every row replays the same prompts, so a cache would serve later rows from KV "
        "computed by earlier ones (and only for non-deterministic prompts)",
    )
    p.add_argument("--sweep-windows", type=int_list, default=[16, 32, 64, 128])
    p.add_argument("--sweep-groups", type=int_list, default=[1, 4, 8])
    p.add_argument("--sweep-share", type=int, default=50, help="percent deterministic")
    p.add_argument("--sweep-requests", type=int, default=None, help="default: --num-requests")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over all rows of a part (rows interleaved); rows report medians",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes: 24 requests, prompts 16..64, outputs 16..48 (sizes given "
        "explicitly on the command line still win)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
    args = p.parse_args(argv)
    if args.quick:
        if "--num-requests" not in given:
            args.num_requests = 24
        if "--prompt-len" not in given:
            args.prompt_len = (16, 64)
        if "--output-len" not in given:
            args.output_len = (16, 48)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    args.baselines = [x.strip() for x in args.baselines.split(",") if x.strip()]
    return args


# --------------------------------------------------------------------------- workload


def make_workload(n: int, args: argparse.Namespace, vocab: int, seed: int) -> dict:
    """Prompts, output lengths and a fixed order in which requests turn deterministic (the
    first k of ``det_order`` are deterministic at share k/n, so the sets are nested)."""
    rng = np.random.default_rng(seed)
    plens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, size=n)
    olens = rng.integers(args.output_len[0], args.output_len[1] + 1, size=n)
    prompts = [[int(t) for t in rng.integers(2, vocab, size=int(k))] for k in plens]
    return {
        "prompts": prompts,
        "output_lens": [int(x) for x in olens],
        "det_order": [int(x) for x in rng.permutation(n)],
        "seeds": [int(x) for x in rng.integers(0, 2**31, size=n)],
        "gaps": [float(x) for x in rng.exponential(1.0, size=n)],  # unit-rate inter-arrivals
    }


def n_det(n: int, share_pct: float) -> int:
    """Deterministic requests at a share: at least one for any share > 0."""
    k = int(round(share_pct / 100.0 * n))
    return max(k, 1) if share_pct > 0 else 0


def params_for(wl: dict, share_pct: float, temperature: float) -> list:
    from detspec import SamplingParams

    n = len(wl["prompts"])
    det = set(wl["det_order"][: n_det(n, share_pct)])
    return [
        SamplingParams(
            temperature=temperature,
            seed=wl["seeds"][i],
            max_tokens=wl["output_lens"][i],
            ignore_eos=True,
            deterministic=i in det,
        )
        for i in range(n)
    ]


# --------------------------------------------------------------------------- engines


class Config:
    """One row: an engine configuration and the share of deterministic requests."""

    def __init__(self, label: str, share: float, mode: str = "dvr", **engine_kw) -> None:
        self.label = label
        self.share = share
        self.mode = mode
        self.engine_kw = {"determinism": mode, **engine_kw}

    def key(self) -> tuple:
        return tuple(sorted(self.engine_kw.items()))


def warm_up(llm, vocab: int, det: bool) -> None:
    from detspec import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, deterministic=det)
    llm.generate([[2 + (i % (vocab - 2))] * 8 for i in range(2)], sp, use_tqdm=False)


def stats_delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def derived(stats: dict, out_tokens: int, windows: int) -> dict:
    vp = stats["num_verify_passes"]
    return {
        "rollbacks_per_pass": stats["num_rollbacks"] / vp if vp else 0.0,
        "rollbacks_per_window": stats["num_rollbacks"] / windows if windows else 0.0,
        "recomputed_share": stats["num_rolled_back_tokens"] / out_tokens if out_tokens else 0.0,
        "padded_rows_per_token": stats["num_padded_rows"] / out_tokens if out_tokens else 0.0,
    }


def run_offline(llm, wl: dict, cfg: Config, args) -> dict:
    params = params_for(wl, cfg.share if cfg.mode == "dvr" else 0, args.temperature)
    before = llm.stats()
    c0 = time.process_time()
    t0 = time.perf_counter()
    outs = llm.generate(wl["prompts"], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    stats = stats_delta(llm.stats(), before)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(wl["output_lens"]), "ignore_eos runs must produce every token"
    windows = sum(int(o.metrics.get("num_verify_passes") or 0) for o in outs)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "tok_per_cpu_s": out_tokens / cpu,
        "requests_per_s": len(outs) / wall,
        "deterministic_requests": sum(p.deterministic for p in params),
        "verify_windows": windows,
        **stats,
        **derived(stats, out_tokens, windows),
    }


def run_poisson(engine, wl: dict, cfg: Config, rate: float, args, tag: str) -> dict:
    params = params_for(wl, cfg.share if cfg.mode == "dvr" else 0, args.temperature)
    arrivals = np.cumsum(np.array(wl["gaps"]) / rate) - wl["gaps"][0] / rate  # first at 0
    recs: list[dict] = []

    async def one(i: int, t_sub: float) -> None:
        first = None
        last = None
        async for out in engine.generate(wl["prompts"][i], params[i], request_id=f"{tag}-{i}"):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            last = out
        end = time.perf_counter()
        recs.append(
            {
                "ttft_s": first - t_sub,
                "e2e_s": end - t_sub,
                "end": end,
                "tokens": len(last.outputs[0].token_ids),
                "windows": int(last.metrics.get("num_verify_passes") or 0),
            }
        )

    async def main() -> float:
        t0 = time.perf_counter()
        tasks = []
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, time.perf_counter())))
        await asyncio.gather(*tasks)
        return t0

    before = engine.stats()
    c0 = time.process_time()
    t0 = asyncio.run(main())
    cpu = time.process_time() - c0
    stats = stats_delta(engine.stats(), before)
    wall = max(r["end"] for r in recs) - t0
    out_tokens = sum(r["tokens"] for r in recs)
    windows = sum(r["windows"] for r in recs)
    return {
        "rate_req_s": rate,
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "tok_per_cpu_s": out_tokens / cpu,
        "mean_ttft_s": statistics.fmean(r["ttft_s"] for r in recs),
        "mean_e2e_s": statistics.fmean(r["e2e_s"] for r in recs),
        "p90_e2e_s": float(np.percentile([r["e2e_s"] for r in recs], 90)),
        "deterministic_requests": sum(p.deterministic for p in params),
        "verify_windows": windows,
        **stats,
        **derived(stats, out_tokens, windows),
    }


class Engines:
    """One engine per configuration key, created on first use and warmed up, reused for the
    rows that share it (the deterministic share is per request)."""

    def __init__(self, model_dir: str, vocab: int, asynchronous: bool, extra: dict) -> None:
        self.model_dir = model_dir
        self.vocab = vocab
        self.asynchronous = asynchronous
        self.extra = extra  # engine keyword arguments common to every row
        self.cache: dict[tuple, object] = {}

    def get(self, cfg: Config):
        from detspec import LLM, AsyncLLM

        k = cfg.key()
        if k not in self.cache:
            det = cfg.mode == "dvr"
            kw = {**self.extra, **cfg.engine_kw}
            if self.asynchronous:
                engine = AsyncLLM(self.model_dir, **kw)
                asyncio.run(self._warm_async(engine, det))
            else:
                engine = LLM(self.model_dir, **kw)
                warm_up(engine, self.vocab, det)
            self.cache[k] = engine
        return self.cache[k]

    async def _warm_async(self, engine, det: bool) -> None:
        from detspec import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, deterministic=det)
        async for _ in engine.generate([2] * 8, sp, request_id="warm"):
            pass

    def close(self) -> None:
        for e in self.cache.values():
            e.shutdown()
        self.cache.clear()


def common_engine_kw(args) -> dict:
    import inspect

    from detspec import LLM

    params = inspect.signature(LLM.__init__).parameters
    kw: dict = {}
    if "enable_prefix_caching" in params:
        kw["enable_prefix_caching"] = args.prefix_caching == "on"
    if args.kernel_profile != "invariant":
        kw["kernel_profile"] = args.kernel_profile
    if args.device != "cpu" or args.dtype != "auto":
        kw.update(device=args.device, dtype=args.dtype)
    return kw


def wheel_info() -> dict:
    """Which engine build this process loaded (the wheel may be reinstalled meanwhile)."""
    from detspec import _core

    path = _core.__file__
    st = os.stat(path)
    return {
        "core": path,
        "core_mtime_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(st.st_mtime)),
        "core_size": st.st_size,
    }


def main_configs(args) -> list[Config]:
    wb = {"verify_window": args.verify_window, "verify_group": args.verify_group}
    rows = [Config(f"dvr {s} %", s, **wb) for s in args.det_shares]
    # The default strategy is "inline" on CPU; the replay strategy (the GPU's) side by side.
    replay = {"verify_strategy": "replay", **wb}
    rows += [Config(f"dvr replay {s} %", s, **replay) for s in args.replay_shares]
    if "batch_invariant" in args.baselines:
        rows.append(Config("batch_invariant (100 %)", 100, mode="batch_invariant", **wb))
    if "no_batching" in args.baselines:
        rows.append(Config("no batching (max_num_seqs=1)", 100, mode="off", max_num_seqs=1))
    if args.finish_wait > 0:
        for share in (50, 100):
            rows.append(
                Config(
                    f"dvr replay {share} % + finish wait {args.finish_wait}",
                    share,
                    verify_finish_wait=args.finish_wait,
                    **replay,
                )
            )
    if args.fault_injection > 0:
        rows.append(
            Config(
                f"dvr replay 50 % + {args.fault_injection:g} forced rollbacks",
                50,
                fault_injection=args.fault_injection,
                **replay,
            )
        )
    return rows


# --------------------------------------------------------------------------- parts


def with_reference(rows: list[Config]) -> list[Config]:
    """The plain 0 % DVR row first and again last (the reference is their mean)."""
    ref = next(
        r for r in rows if r.mode == "dvr" and r.share == 0 and "fault_injection" not in r.engine_kw
    )
    again = Config("dvr 0 % (again, last)", 0)
    again.engine_kw = dict(ref.engine_kw)
    return [ref] + [r for r in rows if r is not ref] + [again]


MEANED = (
    "output_tok_s",
    "tok_per_cpu_s",
    "wall_s",
    "cpu_s",
    "requests_per_s",
    "mean_ttft_s",
    "mean_e2e_s",
    "p90_e2e_s",
)


def measure(rows: list[Config], repeats: int, runner) -> list[dict]:
    """Runs every row once per round, rounds one after the other (so slow drifts of the
    machine hit all rows alike). A row reports the median over its runs of throughput and
    latencies (the mean for two runs) and the counters of its first run."""
    per: list[list[dict]] = [[] for _ in rows]
    for rep in range(repeats):
        for i, cfg in enumerate(rows):
            r = runner(cfg, rep, i)
            r.update(label=cfg.label, share=cfg.share, mode=cfg.mode, engine=dict(cfg.engine_kw))
            per[i].append(r)
    out = []
    for runs in per:
        row = dict(runs[0])
        for k in MEANED:
            if k in row:
                row[k] = statistics.median(r[k] for r in runs)
        row["tok_s_runs"] = [r["output_tok_s"] for r in runs]
        row["tok_per_cpu_s_runs"] = [r["tok_per_cpu_s"] for r in runs]
        row["runs"] = runs
        out.append(row)
    return out


def is_reference(r: dict) -> bool:
    return r["share"] == 0 and r["mode"] == "dvr" and "fault_injection" not in r["engine"]


def relate(results: list[dict]) -> dict:
    """Adds ``rel`` (throughput / median of every 0 % run of the part) and ``rel_cpu`` (the
    same for output tokens per CPU-second of the process) to each row; returns the
    references and their spread ((max - min) / median of those runs, a noise indicator)."""
    refs = [x for r in results if is_reference(r) for x in r["tok_s_runs"]]
    cpu_refs = [x for r in results if is_reference(r) for x in r["tok_per_cpu_s_runs"]]
    ref, cpu_ref = statistics.median(refs), statistics.median(cpu_refs)
    for r in results:
        r["rel"] = r["output_tok_s"] / ref
        r["rel_cpu"] = r["tok_per_cpu_s"] / cpu_ref
    return {
        "tok_s": ref,
        "runs": refs,
        "spread": (max(refs) - min(refs)) / ref,
        "tok_per_cpu_s": cpu_ref,
        "cpu_runs": cpu_refs,
        "cpu_spread": (max(cpu_refs) - min(cpu_refs)) / cpu_ref,
    }


def part_offline(args, model_dir, vocab) -> dict:
    wl = make_workload(args.num_requests, args, vocab, args.seed)
    engines = Engines(model_dir, vocab, asynchronous=False, extra=common_engine_kw(args))

    def runner(cfg: Config, rep: int, i: int) -> dict:
        r = run_offline(engines.get(cfg), wl, cfg, args)
        log(f"offline  {cfg.label:40s} {r['output_tok_s']:8.1f} tok/s  {r['wall_s']:6.1f} s")
        return r

    try:
        results = measure(with_reference(main_configs(args)), args.repeats, runner)
    finally:
        engines.close()
    return {"requests": args.num_requests, "rows": results, "reference": relate(results)}


def part_poisson(args, model_dir, vocab) -> dict:
    n = args.poisson_requests or args.num_requests
    wl = make_workload(n, args, vocab, args.seed)
    out: dict = {"requests": n, "rates": []}
    if args.rates == "auto":
        engines = Engines(model_dir, vocab, asynchronous=False, extra=common_engine_kw(args))
        try:
            cfg = Config(
                "dvr 0 %",
                0,
                verify_window=args.verify_window,
                verify_group=args.verify_group,
            )
            cap = run_offline(engines.get(cfg), wl, cfg, args)["requests_per_s"]
        finally:
            engines.close()
        rates = [round(0.5 * cap, 3), round(1.0 * cap, 3)]
        out["auto_capacity_req_s"] = cap
        log(f"poisson  0 % offline capacity {cap:.3f} req/s -> rates {rates}")
    else:
        rates = [float(x) for x in args.rates.split(",")]
    engines = Engines(model_dir, vocab, asynchronous=True, extra=common_engine_kw(args))
    try:
        for ri, rate in enumerate(rates):

            def runner(cfg: Config, rep: int, i: int, rate=rate, ri=ri) -> dict:
                r = run_poisson(engines.get(cfg), wl, cfg, rate, args, tag=f"p{ri}-{rep}-{i}")
                log(
                    f"poisson {rate:6.3f} req/s {cfg.label:40s} {r['output_tok_s']:8.1f} tok/s  "
                    f"e2e {r['mean_e2e_s']:6.2f} s"
                )
                return r

            results = measure(with_reference(main_configs(args)), args.repeats, runner)
            out["rates"].append({"rate_req_s": rate, "rows": results, "reference": relate(results)})
    finally:
        engines.close()
    return out


def part_sweep(args, model_dir, vocab) -> dict:
    n = args.sweep_requests or args.num_requests
    wl = make_workload(n, args, vocab, args.seed)
    rows = [Config("dvr 0 %", 0, verify_window=args.verify_window)]
    for w in args.sweep_windows:
        for b in args.sweep_groups:
            rows.append(Config(f"W={w} B={b}", args.sweep_share, verify_window=w, verify_group=b))
    rows.append(Config("dvr 0 % (again, last)", 0, verify_window=args.verify_window))
    engines = Engines(model_dir, vocab, asynchronous=False, extra=common_engine_kw(args))

    def runner(cfg: Config, rep: int, i: int) -> dict:
        r = run_offline(engines.get(cfg), wl, cfg, args)
        log(f"sweep    {cfg.label:40s} {r['output_tok_s']:8.1f} tok/s  {r['wall_s']:6.1f} s")
        if cfg.share:  # free the engine (and its KV pool): the sweep builds 12
            engines.cache.pop(cfg.key()).shutdown()
        return r

    try:
        results = measure(rows, args.repeats, runner)
    finally:
        engines.close()
    return {
        "requests": n,
        "share": args.sweep_share,
        "rows": results,
        "reference": relate(results),
    }


# --------------------------------------------------------------------------- output


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ref_line(ref: dict) -> str:
    runs = ", ".join(f"{x:.1f}" for x in ref["runs"])
    cpu = ", ".join(f"{x:.1f}" for x in ref["cpu_runs"])
    return (
        f"\n0 % reference: {ref['tok_s']:.1f} tok/s, median of the 0 % runs ({runs}); "
        f"spread {pct(ref['spread'])}. Per CPU-second: {ref['tok_per_cpu_s']:.1f} ({cpu}); "
        f"spread {pct(ref['cpu_spread'])}\n"
    )


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def table_main(rows: list[dict], poisson: bool) -> str:
    head = (
        "| configuration | det. requests | output tok/s | rel. to 0 % | out tok / CPU-s |"
        " rel. (CPU) |"
    )
    sep = "|---|---:|---:|---:|---:|---:|"
    if poisson:
        head += " mean TTFT s | mean e2e s |"
        sep += "---:|---:|"
    head += (
        " verify passes | rollbacks / pass | rollbacks / window | recomputed |"
        " padded rows / out tok |"
    )
    sep += "---:|---:|---:|---:|---:|"
    lines = [head, sep]
    for r in rows:
        det = r["deterministic_requests"] if r["mode"] == "dvr" else f"all ({r['mode']})"
        line = (
            f"| {r['label']} | {det} | {r['output_tok_s']:.1f} | {r['rel']:.3f} | "
            f"{r['tok_per_cpu_s']:.1f} | {r['rel_cpu']:.3f} |"
        )
        if poisson:
            line += f" {r['mean_ttft_s']:.2f} | {r['mean_e2e_s']:.2f} |"
        line += (
            f" {r['num_verify_passes']} | {r['rollbacks_per_pass']:.3f} | "
            f"{r['rollbacks_per_window']:.3f} | {pct(r['recomputed_share'])} | "
            f"{r['padded_rows_per_token']:.2f} |"
        )
        lines.append(line)
    return "\n".join(lines)


def table_sweep(rows: list[dict], windows: list[int], groups: list[int]) -> str:
    by = {
        (r["engine"].get("verify_window"), r["engine"].get("verify_group")): r
        for r in rows
        if r["share"]
    }
    lines = [
        "output throughput relative to 0 %, wall-clock / per CPU-second (padded verify rows "
        "per output token; recomputed-token share)",
        "",
        "| W \\ B | " + " | ".join(f"B={b}" for b in groups) + " |",
        "|---|" + "---|" * len(groups),
    ]
    for w in windows:
        cells = []
        for b in groups:
            r = by.get((w, b))
            cells.append(
                "-"
                if r is None
                else f"{r['rel']:.3f} / {r['rel_cpu']:.3f} ({r['padded_rows_per_token']:.1f}; "
                f"{pct(r['recomputed_share'])})"
            )
        lines.append(f"| W={w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench_model import bench_model, vocab_size

    import detspec

    args.model_dir = bench_model(args.model_dir, args.model)
    model_dir = str(args.model_dir)
    vocab = vocab_size(model_dir)

    t_start = time.perf_counter()
    report: dict = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "rayon_num_threads": os.environ.get("RAYON_NUM_THREADS"),
            "loadavg_start": os.getloadavg(),
            "detspec": getattr(detspec, "__version__", None),
            "wheel": wheel_info(),
            "common_engine_kw": common_engine_kw(args),
        },
    }
    print(
        f"model {args.model} ({model_dir}); requests {args.num_requests}, prompts "
        f"{args.prompt_len[0]}..{args.prompt_len[1]}, outputs {args.output_len[0]}.."
        f"{args.output_len[1]} tokens (ignore_eos), temperature {args.temperature}; "
        f"W={args.verify_window} B={args.verify_group}; engine {common_engine_kw(args)}; "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; detspec core installed "
        f"{report['machine']['wheel']['core_mtime_utc']} UTC\n"
    )
    if "offline" in args.parts:
        res = part_offline(args, model_dir, vocab)
        report["offline"] = res
        print(f"### Offline ({res['requests']} requests at once)\n")
        print(table_main(res["rows"], poisson=False))
        print(ref_line(res["reference"]))
    if "poisson" in args.parts:
        res = part_poisson(args, model_dir, vocab)
        report["poisson"] = res
        for rr in res["rates"]:
            print(
                f"### Poisson arrivals, {rr['rate_req_s']:.3f} requests/s "
                f"({res['requests']} requests)\n"
            )
            print(table_main(rr["rows"], poisson=True))
            print(ref_line(rr["reference"]))
    if "sweep" in args.parts:
        res = part_sweep(args, model_dir, vocab)
        report["sweep"] = res
        print(
            f"### W x B sweep, {res['share']} % deterministic, offline "
            f"({res['requests']} requests)\n"
        )
        print(table_sweep(res["rows"], args.sweep_windows, args.sweep_groups))
        print(ref_line(res["reference"]))
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["machine"]["wheel_at_end"] = wheel_info()
    report["wall_s"] = time.perf_counter() - t_start
    print(f"total wall {report['wall_s']:.0f} s; load average at end {os.getloadavg()[0]:.1f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
