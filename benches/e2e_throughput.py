"""End-to-end continuous-batching benchmark: detspec vs Hugging Face transformers.

Builds the benchmark model of docs/architecture.md (Llama-shaped, random weights: hidden 512,
8 layers, 8 heads, 4 KV heads, intermediate 1408, vocab 32000) with
``detspec._core.write_demo_model(dir, "bench", 0)`` and measures, in one run:

* detspec (``AsyncLLM``, greedy, ``ignore_eos=True``): output tokens/s with 1, 4, 16, 64
  requests in flight at once, the speed-up of 16 over 1, and the medians of
  time-to-first-token (TTFT) and time-per-output-token (TPOT) measured in the asyncio
  consumer (submit -> first snapshot; (last - first snapshot) / (tokens - 1)).
* transformers ``generate`` on the SAME model directory (float32, greedy,
  ``min_new_tokens = max_new_tokens``, left padding), with the same prompts and lengths,
  at batch 1 and 16 (each over the same prompts as detspec's level of that concurrency,
  in batches). Its TTFT is the time of ``generate(max_new_tokens=1)`` on a batch and its
  TPOT (full generate - TTFT) / (tokens - 1).

Speed is a measurement, never a test: this script prints a Markdown table
and writes JSON (``--out``); nothing here asserts a speed.

Threads: transformers runs with ``torch.set_num_threads(--threads)`` (default: all cores)
and, unless the environment says otherwise, ``OMP_WAIT_POLICY=PASSIVE``: with the default
(active) policy, idle OpenMP threads spin, and on a machine where anything else runs (a
compiler, the other engine's threads) a 2-thread torch slows down several-fold, which
would flatter detspec. detspec's kernels run on its rayon pool, which uses all cores
unless ``RAYON_NUM_THREADS`` is set. All of these go into the JSON, with the load average
before each measurement and the process CPU time each one used (``tok/CPU-s``: output
tokens per second of CPU time, less sensitive to other load than tokens per wall second).

``--rounds N`` repeats every measurement N times, alternating detspec and transformers;
the table shows the median of the rounds.

    python benches/e2e_throughput.py --out bench-e2e.json            # full sizes
    python benches/e2e_throughput.py --quick --out bench-e2e.json    # smaller, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# must be set before torch (imported lazily below) starts its OpenMP runtime
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the benchmark model is (written there if missing); "
        "default: a temporary directory",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--concurrency",
        type=str,
        default="1,4,16,64",
        help="comma-separated numbers of requests in flight at once",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=4,
        help="each level runs max(concurrency, this) requests, at most "
        "`concurrency` in flight (so concurrency 1 averages several requests)",
    )
    p.add_argument(
        "--hf-batches",
        type=str,
        default="1,16",
        help="comma-separated transformers batch sizes ('' to skip HF)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="torch intra-op threads for transformers (default: all cores)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="repeat every measurement")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes: prompt 64, output 32, concurrency 1,4,16, HF 1,16",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len, args.output_len = 64, 32
        args.concurrency, args.min_requests = "1,4,16", 2
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",") if b.strip()]
    return args


def make_prompts(n: int, length: int, vocab: int, *seed: int) -> list[list[int]]:
    """Random token-id prompts (ids 2.. avoid the special tokens). Every (level, round) gets
    its own prompts, so an engine with a prefix cache never reuses an earlier measurement's
    KV; detspec and transformers get the same prompts for the same (level, round)."""
    rng = np.random.default_rng(list(seed))
    return [[int(t) for t in rng.integers(2, vocab, size=length)] for _ in range(n)]


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def cpu_seconds() -> float:
    """CPU time of this process, all threads (engine, rayon/OpenMP workers, Python)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


# --------------------------------------------------------------------------- detspec


async def detspec_level(engine, prompts, concurrency: int, output_len: int, tag: str) -> dict:
    """Runs all `prompts` with at most `concurrency` in flight; client-side timings."""
    from detspec import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)
    records = []

    async def one(i: int, prompt: list[int]) -> None:
        async with gate:
            t0 = time.perf_counter()
            t_first = None
            last = None
            async for out in engine.generate(prompt, params, request_id=f"{tag}-{i}"):
                if t_first is None and out.outputs[0].token_ids:
                    t_first = time.perf_counter()
                last = out
            t_end = time.perf_counter()
            n = len(last.outputs[0].token_ids)
            assert last.finished and n == output_len, (n, last.outputs[0].finish_reason)
            records.append(
                {
                    "ttft_s": t_first - t0,
                    "tpot_s": (t_end - t_first) / (n - 1) if n > 1 else None,
                    "tokens": list(last.outputs[0].token_ids),
                    "index": i,
                }
            )

    load, c0, t0 = loadavg(), cpu_seconds(), time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    out_tokens = sum(len(r["tokens"]) for r in records)
    records.sort(key=lambda r: r["index"])
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "wall_s": wall,
        "cpu_s": cpu,
        "loadavg_before": load,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "output_tok_per_cpu_s": out_tokens / cpu,
        "ttft_median_s": median(r["ttft_s"] for r in records),
        "tpot_median_s": median(r["tpot_s"] for r in records),
        "tokens": [r["tokens"] for r in records],
    }


class DetspecRunner:
    def __init__(self, model_dir: Path, args) -> None:
        from detspec import AsyncLLM

        t0 = time.perf_counter()
        self.engine = AsyncLLM(str(model_dir), max_num_seqs=max(256, *args.concurrency))
        self.load_s = time.perf_counter() - t0
        self.vocab = self.engine._engine.vocab_size()
        self.args = args
        self.levels_run = 0
        self.kv_stats = None

    def warm_up(self) -> None:
        from detspec import SamplingParams

        warm = make_prompts(1, self.args.prompt_len, self.vocab, self.args.seed, 99)[0]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        async def run():
            async for _ in self.engine.generate(warm, params, request_id="warm-up"):
                pass

        asyncio.run(run())

    def level(self, c: int, rnd: int) -> dict:
        a = self.args
        prompts = make_prompts(max(c, a.min_requests), a.prompt_len, self.vocab, a.seed, rnd, c)
        self.levels_run += 1
        tag = f"l{self.levels_run}"
        res = asyncio.run(detspec_level(self.engine, prompts, c, a.output_len, tag))
        log(f"detspec c={c}", res)
        return res

    def info(self) -> dict:
        return {
            "load_s": self.load_s,
            "vocab_size": self.vocab,
            "engine": "AsyncLLM (default engine settings; requests not deterministic)",
            "kv_stats_at_end": self.kv_stats,
        }

    def close(self) -> None:
        # prefix-cache hits would make the measurement unfair: record them (expected: 0)
        stats = getattr(self.engine, "kv_stats", None)
        self.kv_stats = stats() if stats is not None else None
        self.engine.shutdown()


# --------------------------------------------------------------------------- transformers


class HFRunner:
    def __init__(self, model_dir: Path, args) -> None:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        torch.set_num_threads(args.threads)
        try:
            model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        except TypeError:  # transformers < 4.56 only knows torch_dtype
            model = transformers.LlamaForCausalLM.from_pretrained(
                model_dir, torch_dtype=torch.float32
            )
        self.model = model.eval()
        self.torch = torch
        self.vocab = model.config.vocab_size
        cfg = model.config
        self.pad = cfg.bos_token_id if cfg.pad_token_id is None else cfg.pad_token_id
        self.args = args
        self._info = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
        }

    def _generate(self, prompts, new_tokens):
        torch = self.torch
        width = max(map(len, prompts))  # left padding (the prompts are equally long here)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=self.pad,
                eos_token_id=None,
            )
            return time.perf_counter() - t0, out[:, width:].tolist()

    def warm_up(self) -> None:
        self._generate(make_prompts(1, self.args.prompt_len, self.vocab, self.args.seed, 99), 4)

    def level(self, b: int, rnd: int) -> dict:
        a = self.args
        # the same prompts as detspec's level with this concurrency, in batches of b
        prompts = make_prompts(max(b, a.min_requests), a.prompt_len, self.vocab, a.seed, rnd, b)
        ttfts, wall, cpu, tokens = [], 0.0, 0.0, []
        load = loadavg()
        for k in range(0, len(prompts), b):
            chunk = prompts[k : k + b]
            c0 = cpu_seconds()
            dt, toks = self._generate(chunk, a.output_len)
            cpu += cpu_seconds() - c0
            wall += dt
            tokens += toks
            ttfts.append(self._generate(chunk, 1)[0])
        ttft = median(ttfts)
        per_batch = wall / len(ttfts)  # one batch's full generate
        out_tokens = sum(len(t) for t in tokens)
        res = {
            "batch": b,
            "requests": len(prompts),
            "wall_s": wall,
            "cpu_s": cpu,
            "loadavg_before": load,
            "output_tokens": out_tokens,
            "output_tok_s": out_tokens / wall,
            "output_tok_per_cpu_s": out_tokens / cpu,
            "ttft_median_s": ttft,
            "tpot_median_s": (per_batch - ttft) / (a.output_len - 1) if a.output_len > 1 else None,
            "tokens": tokens,
        }
        log(f"transformers batch={b}", res)
        return res

    def info(self) -> dict:
        return self._info

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- report


def log(label: str, r: dict) -> None:
    print(
        f"  {label:<22} {r['output_tok_s']:8.1f} tok/s  {r['output_tok_per_cpu_s']:7.1f} "
        f"tok/CPU-s  TTFT {r['ttft_median_s'] * 1e3:6.0f} ms  "
        f"TPOT {r['tpot_median_s'] * 1e3:6.1f} ms  wall {r['wall_s']:5.1f} s  "
        f"load {r['loadavg_before']:.1f}",
        file=sys.stderr,
        flush=True,
    )


def combine(rounds: list[dict]) -> dict:
    """Median over rounds of each numeric field; the token ids of the first round."""
    out = dict(rounds[0])
    for field in ("wall_s", "cpu_s", "output_tok_s", "output_tok_per_cpu_s"):
        out[field] = median(r[field] for r in rounds)
    for field in ("ttft_median_s", "tpot_median_s", "loadavg_before"):
        out[field] = median(r[field] for r in rounds)
    out["rounds"] = [{k: v for k, v in r.items() if k != "tokens"} for r in rounds]
    return out


def fmt(x, scale=1.0, digits=1) -> str:
    return "–" if x is None else f"{x * scale:.{digits}f}"


def markdown(result: dict) -> str:
    ds = result["detspec"]
    hf = {r["batch"]: r for r in result["transformers"]}
    base = {c["concurrency"]: c for c in ds}.get(1)
    lines = [
        "| engine | concurrent requests | output tok/s | vs detspec @ 1 | vs transformers "
        "@ same batch | TTFT median (ms) | TPOT median (ms) | output tok / CPU-s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ds:
        c = r["concurrency"]
        ratio1 = fmt(r["output_tok_s"] / base["output_tok_s"], digits=2) + "×" if base else "–"
        vs_hf = (fmt(r["output_tok_s"] / hf[c]["output_tok_s"], digits=2) + "×") if c in hf else "–"
        lines.append(
            f"| detspec | {c} | {fmt(r['output_tok_s'])} | {ratio1} | {vs_hf} | "
            f"{fmt(r['ttft_median_s'], 1e3, 0)} | {fmt(r['tpot_median_s'], 1e3, 1)} | "
            f"{fmt(r['output_tok_per_cpu_s'])} |"
        )
    for b, r in hf.items():
        lines.append(
            f"| transformers `generate` | {b} (batch) | {fmt(r['output_tok_s'])} | – | 1.00× | "
            f"{fmt(r['ttft_median_s'], 1e3, 0)} | {fmt(r['tpot_median_s'], 1e3, 1)} | "
            f"{fmt(r['output_tok_per_cpu_s'])} |"
        )
    s = result["summary"]
    if s.get("speedup_16_over_1") is not None:
        lines.append("")
        lines.append(
            f"detspec speed-up of 16 concurrent requests over 1: **{s['speedup_16_over_1']:.2f}×**"
        )
    if s.get("greedy_agreement"):
        lines.append("")
        lines.append(
            "Greedy agreement detspec vs transformers (same prompts): "
            + "; ".join(
                f"batch {b}: {a['identical']}/{a['requests']} outputs identical, "
                f"{a['matching_tokens']}/{a['tokens']} tokens before the first difference"
                for b, a in s["greedy_agreement"].items()
            )
        )
    return "\n".join(lines)


def agreement(ds_tokens, hf_tokens) -> dict:
    same = 0
    prefix = 0
    total = 0
    for a, b in zip(ds_tokens, hf_tokens, strict=True):
        same += int(a == b)
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        prefix += k
        total += len(a)
    return {
        "requests": len(ds_tokens),
        "identical": same,
        "matching_tokens": prefix,
        "tokens": total,
    }


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "rayon_threads": int(os.environ.get("RAYON_NUM_THREADS") or os.cpu_count()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": loadavg(),
        "nice": os.nice(0),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench_model import bench_model, model_config

    from detspec import __version__ as detspec_version

    model_dir = bench_model(args.model_dir, "bench", verbose=True)
    config = model_config(model_dir)
    model_keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    )
    result: dict = {
        "command": " ".join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(),
        "model": {k: config.get(k) for k in model_keys},
        "workload": {
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "greedy": True,
            "ignore_eos": True,
            "quick": args.quick,
            "min_requests": args.min_requests,
            "rounds": args.rounds,
        },
        "detspec_version": detspec_version,
    }

    ds_runner = DetspecRunner(model_dir, args)
    hf_runner = HFRunner(model_dir, args) if args.hf_batches else None
    ds_rounds: dict[int, list[dict]] = {c: [] for c in args.concurrency}
    hf_rounds: dict[int, list[dict]] = {b: [] for b in args.hf_batches}
    try:
        ds_runner.warm_up()
        if hf_runner is not None:
            hf_runner.warm_up()
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            for c in args.concurrency:
                ds_rounds[c].append(ds_runner.level(c, r))
            for b in args.hf_batches:
                hf_rounds[b].append(hf_runner.level(b, r))
    finally:
        ds_runner.close()
    ds = [combine(ds_rounds[c]) for c in args.concurrency]
    hf = [combine(hf_rounds[b]) for b in args.hf_batches]
    result["detspec"] = ds
    result["detspec_info"] = ds_runner.info()
    result["transformers"] = hf
    result["transformers_info"] = hf_runner.info() if hf_runner is not None else {}

    by_c = {r["concurrency"]: r for r in ds}
    summary: dict = {"speedup_16_over_1": None, "greedy_agreement": {}}
    if 1 in by_c and 16 in by_c:
        summary["speedup_16_over_1"] = by_c[16]["output_tok_s"] / by_c[1]["output_tok_s"]
    for r in hf:
        if r["batch"] in by_c:
            b = r["batch"]
            summary[f"detspec_over_hf_batch{b}"] = by_c[b]["output_tok_s"] / r["output_tok_s"]
            summary["greedy_agreement"][b] = agreement(by_c[b]["tokens"], r["tokens"])
    result["summary"] = summary
    table = markdown(result)
    result["markdown"] = table
    print(table)
    if args.out is not None:
        for r in ds + hf:  # the token ids are only for the agreement check
            r.pop("tokens", None)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
