"""Soak test of ``detspec serve`` (loopback only, bounded in time; not run in CI).

Starts a server on 127.0.0.1 with a KV pool small enough to force preemption, records the solo
output of a set of deterministic probe requests, then lets many concurrent clients send
thousands of requests: plain and deterministic, streaming and not, random lengths, about a
fifth of them hanging up mid-request. Checks: no unexpected error, every deterministic output
identical (token ids and logprob bits) to its solo run, preemptions happened, every KV page
back at the end, and SIGTERM ends the server with exit status 0.

    python benches/serve_soak.py --duration 300 --clients 48 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import httpx
from serve_process import free_port, wait_ready


def metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            keep_labels = "finished_reason=" in k or "status=" in k
            out[k if keep_labels else k.split("{")[0]] = float(v)
    return out


def bits(choice: dict[str, Any]) -> tuple:
    lp = choice["logprobs"]
    return (
        tuple(choice["token_ids"]),
        tuple(struct.pack("<f", x) for x in lp["token_logprobs"]),
    )


class Soak:
    def __init__(self, args: argparse.Namespace, base: str) -> None:
        self.args = args
        self.base = base
        self.rng = random.Random(args.seed)
        self.stats: Counter[str] = Counter()
        self.errors: list[str] = []
        self.mismatches: list[str] = []
        self.probes: list[dict[str, Any]] = []
        self.solo: list[tuple] = []

    def make_probes(self) -> None:
        rng = random.Random(self.args.seed + 1)
        for i in range(self.args.probes):
            self.probes.append(
                {
                    "prompt": [rng.randrange(3, 900) for _ in range(rng.randint(4, 80))],
                    "max_tokens": rng.randint(8, 48),
                    "temperature": 0.0 if i % 2 == 0 else 0.8,
                    "seed": rng.randrange(2**31),
                    "logprobs": 1,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "deterministic": True,
                }
            )

    async def solo_runs(self, client: httpx.AsyncClient) -> None:
        for p in self.probes:
            r = await client.post("/v1/completions", json=p)
            r.raise_for_status()
            self.solo.append(bits(r.json()["choices"][0]))

    async def one(self, client: httpx.AsyncClient) -> None:
        rng = self.rng
        hang_up = rng.random() < self.args.disconnect_share
        probe_idx = None
        if rng.random() < self.args.deterministic_share:
            probe_idx = rng.randrange(len(self.probes))
            body = dict(self.probes[probe_idx])
        else:
            body = {
                "prompt": [rng.randrange(3, 900) for _ in range(rng.randint(1, 120))],
                "max_tokens": rng.randint(1, 64),
                "temperature": rng.choice([0.0, 0.7, 1.0]),
                "seed": rng.randrange(2**31),
                "ignore_eos": rng.random() < 0.7,
                "n": rng.choice([1, 1, 1, 2]),
            }
        stream = rng.random() < 0.6
        body["stream"] = stream
        if stream and probe_idx is not None:
            body["stream_options"] = {"include_usage": True}
        kind = ("det" if probe_idx is not None else "plain") + ("-stream" if stream else "")
        self.stats["sent"] += 1
        self.stats[kind] += 1
        try:
            if hang_up:
                self.stats["hung_up"] += 1
                # read a little (or nothing), then close the connection
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        self.errors.append(f"hang-up request got {r.status_code}")
                        return
                    if stream:
                        n = 0
                        async for _ in r.aiter_lines():
                            n += 1
                            if n >= rng.randint(1, 4):
                                break
                    else:
                        await asyncio.sleep(rng.uniform(0.0, 0.05))
                return
            if stream:
                ids: list[int] = []
                lps: list[bytes] = []
                done = False
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        self.errors.append(f"{kind}: HTTP {r.status_code} {await r.aread()!r}")
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.errors.append(f"{kind}: stream error {chunk['error']}")
                            return
                        for c in chunk["choices"]:
                            ids.extend(c.get("token_ids") or [])
                            if c.get("logprobs"):
                                lps.extend(
                                    struct.pack("<f", x) for x in c["logprobs"]["token_logprobs"]
                                )
                if not done:
                    self.errors.append(f"{kind}: stream ended without [DONE]")
                    return
                if probe_idx is not None:
                    self.check(probe_idx, (tuple(ids), tuple(lps)))
            else:
                r = await client.post("/v1/completions", json=body)
                if r.status_code != 200:
                    self.errors.append(f"{kind}: HTTP {r.status_code} {r.text[:200]}")
                    return
                if probe_idx is not None:
                    self.check(probe_idx, bits(r.json()["choices"][0]))
            self.stats["completed"] += 1
        except httpx.HTTPError as e:
            self.errors.append(f"{kind}: {type(e).__name__}: {e}")

    def check(self, idx: int, got: tuple) -> None:
        self.stats["det_checked"] += 1
        if got != self.solo[idx]:
            self.mismatches.append(f"probe {idx}: differs from its solo run")

    async def client_loop(self, client: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline and self.stats["sent"] < self.args.requests:
            await self.one(client)


async def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    soak = Soak(args, base)
    soak.make_probes()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        t0 = time.perf_counter()
        await soak.solo_runs(client)
        solo_s = time.perf_counter() - t0
        deadline = time.monotonic() + args.duration
        t0 = time.perf_counter()
        await asyncio.gather(*[soak.client_loop(client, deadline) for _ in range(args.clients)])
        elapsed = time.perf_counter() - t0
    return {
        "solo_runs_s": solo_s,
        "soak_s": elapsed,
        "stats": dict(soak.stats),
        "errors": soak.errors[:20],
        "num_errors": len(soak.errors),
        "mismatches": soak.mismatches[:20],
        "num_mismatches": len(soak.mismatches),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the tiny demo model)")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load (max 540)")
    ap.add_argument("--requests", type=int, default=5000, help="stop after this many")
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--probes", type=int, default=24, help="distinct deterministic requests")
    ap.add_argument("--deterministic-share", type=float, default=0.3)
    ap.add_argument("--disconnect-share", type=float, default=0.2)
    ap.add_argument("--num-kv-pages", type=int, default=96, help="small: forces preemption")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--verify-strategy", choices=("auto", "replay", "inline"), default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.duration = min(args.duration, 540.0)  # with start-up and checks: under 10 minutes

    model = args.model
    if model is None:
        import detspec

        model = tempfile.mkdtemp(prefix="soak-model-")
        detspec._core.write_demo_model(model, "tiny", 5)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="soak-server-", suffix=".log", delete=False)
    cmd = [
        sys.executable, "-m", "detspec", "serve", model, "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", "512", "--num-kv-pages", str(args.num_kv_pages),
        "--max-num-seqs", str(args.max_num_seqs), "--verify-strategy", args.verify_strategy,
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    result: dict[str, Any] = {"args": vars(args), "server_log": log.name}
    try:
        wait_ready(base)
        result["load_before"] = os.getloadavg()
        result.update(asyncio.run(run(args, base)))
        result["load_after"] = os.getloadavg()
        # every page back: wait for the aborted/finished requests to drain
        m: dict[str, float] = {}
        for _ in range(300):
            m = metrics(base)
            if m["detspec:kv_cache_used_pages"] == 0 and m["detspec:num_requests_running"] == 0:
                break
            time.sleep(0.1)
        result["final_metrics"] = {
            k: v
            for k, v in m.items()
            if not k.endswith("_created") and "_bucket" not in k and "_sum" not in k
        }
        result["kv_pages_used_at_end"] = m["detspec:kv_cache_used_pages"]
        result["preemptions"] = m["detspec:num_preemptions_total"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            result["server_exit_status"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            result["server_exit_status"] = "killed"
    ok = (
        result.get("num_errors") == 0
        and result.get("num_mismatches") == 0
        and result.get("kv_pages_used_at_end") == 0
        and result.get("server_exit_status") == 0
        and result.get("stats", {}).get("det_checked", 0) > 0
    )
    result["ok"] = ok
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
