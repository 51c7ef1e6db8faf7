"""``detspec bench serve``: a serving benchmark shaped like ``vllm bench serve``.

Sends requests to a running server through real HTTP (SSE streaming, as a client sees it)
at a fixed concurrency or with Poisson arrivals, a share of them ``deterministic``, with
random or given prompt/output lengths (prompts are random token ids, ``ignore_eos`` makes
the output length exact). Prints and writes JSON: request and token throughput and TTFT /
TPOT / ITL / end-to-end latency percentiles. ``--backend inprocess`` runs the same workload
on an in-process ``AsyncLLM`` instead (what HTTP costs, by difference).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from detspec.engine_args import add_engine_arguments, engine_settings_from_args


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int
    deterministic: bool
    seed: int


@dataclass
class RequestResult:
    ok: bool
    deterministic: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    def arrived(self, ntok: int, start: float, last: float) -> float:
        """Records ``ntok`` tokens arriving now (the request started at ``start``, the last
        tokens arrived at ``last``); returns now."""
        now = time.perf_counter()
        if self.output_tokens == 0:
            self.ttft = now - start
        else:
            self.itl.append(now - last)
        self.output_tokens += ntok
        return now


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("openai", "inprocess"), default="openai")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("DETSPEC_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many in flight")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in requests/s (default inf: all at once)",
    )
    p.add_argument(
        "--deterministic-fraction",
        type=float,
        default=0.0,
        help="share of requests sent with deterministic=true (0..1)",
    )
    p.add_argument("--random-input-len", type=int, default=64)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]",
    )
    p.add_argument(
        "--lengths-file",
        default=None,
        help="JSON list of [input_len, output_len] pairs (used in turn) instead of random",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None, help="prompt token ids below this")
    p.add_argument("--result-file", default=None, help="write the JSON result here")
    p.add_argument("--label", default="", help="free text stored in the result")
    # inprocess backend: the model and the engine settings (ENGINE_SETTINGS)
    p.add_argument("--model-dir", default=None, help="inprocess: model directory")
    add_engine_arguments(p, prefix="inprocess:")


def make_requests(args: argparse.Namespace, vocab: int) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    pairs: list[tuple[int, int]]
    if args.lengths_file:
        with open(args.lengths_file) as f:
            given = [(int(a), int(b)) for a, b in json.load(f)]
        pairs = [given[i % len(given)] for i in range(args.num_prompts)]
    else:
        r = args.random_range_ratio

        def length(n: int) -> int:
            return max(1, rng.randint(int(n * (1 - r)), max(int(n * (1 - r)), int(n * (1 + r)))))

        pairs = [
            (length(args.random_input_len), length(args.random_output_len))
            for _ in range(args.num_prompts)
        ]
    n_det = round(args.deterministic_fraction * args.num_prompts)
    det = [True] * n_det + [False] * (args.num_prompts - n_det)
    rng.shuffle(det)
    return [
        BenchRequest(
            prompt=[rng.randrange(2, vocab) for _ in range(i)],
            output_len=o,
            deterministic=d,
            seed=rng.randrange(2**31),
        )
        for (i, o), d in zip(pairs, det, strict=True)
    ]


async def _http_request(
    client: Any, args: argparse.Namespace, model: str, req: BenchRequest
) -> RequestResult:
    res = RequestResult(ok=False, deterministic=req.deterministic, prompt_len=len(req.prompt))
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "seed": req.seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "deterministic": req.deterministic,
    }
    if args.endpoint == "chat":
        url = "/v1/chat/completions"
        # token ids do not go through chat: send their text (lengths are then approximate)
        body["messages"] = [{"role": "user", "content": " ".join(map(str, req.prompt))}]
    else:
        url = "/v1/completions"
        body["prompt"] = req.prompt
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                ntok = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if ntok:
                    last = res.arrived(ntok, start, last)
    except Exception as e:  # network errors count as failures, not crashes
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.ok = True
    return res


async def _inprocess_request(
    engine: Any, args: argparse.Namespace, req: BenchRequest, rid: str
) -> RequestResult:
    from detspec.sampling_params import SamplingParams

    res = RequestResult(ok=False, deterministic=req.deterministic, prompt_len=len(req.prompt))
    params = SamplingParams(
        max_tokens=req.output_len,
        temperature=args.temperature,
        seed=req.seed,
        ignore_eos=True,
        deterministic=req.deterministic,
    )
    start = time.perf_counter()
    last = start
    try:
        async for out in engine.generate(req.prompt, params, request_id=rid, delta=True):
            n = len(out.outputs[0].token_ids)
            if n:
                last = res.arrived(n, start, last)
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.ok = True
    return res


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _summary(name: str, xs: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in xs]
    return {
        f"mean_{name}_ms": sum(ms) / len(ms) if ms else float("nan"),
        **{f"p{q}_{name}_ms": _pct(ms, q) for q in (50, 90, 99)},
    }


def summarize(
    results: list[RequestResult], duration: float, args: argparse.Namespace
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    summary: dict[str, Any] = {
        "label": args.label,
        "backend": args.backend,
        "endpoint": args.endpoint,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "max_concurrency": args.max_concurrency,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "deterministic_fraction": args.deterministic_fraction,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **_summary("ttft", [r.ttft for r in ok]),
        **_summary("tpot", tpot),
        **_summary("itl", itl),
        **_summary("e2el", [r.e2e for r in ok]),
    }
    if hasattr(os, "getloadavg"):
        summary["loadavg_after"] = list(os.getloadavg())
    return summary


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    engine: Any = None
    client: Any = None
    model = args.model or ""
    if args.backend == "inprocess":
        from detspec.async_llm import AsyncLLM

        engine = AsyncLLM(args.model_dir, **engine_settings_from_args(args))
        vocab = args.vocab_size or engine.vocab_size
    else:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        client = httpx.AsyncClient(
            base_url=args.base_url, headers=headers, timeout=None, limits=limits
        )
        info = (await client.get("/v1/models")).json()["data"][0]
        model = model or info["id"]
        vocab = args.vocab_size or 256
    requests = make_requests(args, vocab)
    sem = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)

    async def one(i: int, req: BenchRequest) -> RequestResult:
        async with sem:
            if engine is not None:
                return await _inprocess_request(engine, args, req, f"bench-{i}")
            return await _http_request(client, args, model, req)

    tasks = []
    start = time.perf_counter()
    try:
        for i, req in enumerate(requests):
            tasks.append(asyncio.ensure_future(one(i, req)))
            if not math.isinf(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        if client is not None:
            await client.aclose()
        if engine is not None:
            engine.shutdown()
    return summarize(list(results), duration, args)


def bench_serve(args: argparse.Namespace) -> int:
    if args.backend == "openai":
        try:
            import httpx  # noqa: F401
        except ImportError:
            print("error: `detspec bench serve` needs httpx: pip install httpx", file=sys.stderr)
            return 1
    if not 0.0 <= args.deterministic_fraction <= 1.0:
        print("error: --deterministic-fraction must be in [0, 1]", file=sys.stderr)
        return 2
    result = asyncio.run(run_benchmark(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.result_file:
        with open(args.result_file, "w") as f:
            f.write(text + "\n")
    return 0 if result["failed"] == 0 else 1


__all__ = ["BenchRequest", "RequestResult", "add_bench_arguments", "bench_serve"]
