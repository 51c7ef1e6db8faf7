"""``detspec demo``: the determinism contract, shown on the built-in model in under a minute.

One deterministic request (the *needle*) runs alone; then the same request runs inside rounds of
N concurrent random requests arriving at staggered times; its token ids and the bits of every
logprob are compared with the solo run. The same rounds run under ``determinism="off"`` as the
negative control: there the fast path's split-KV decode attention, whose split count depends on
how many sequences share a step, changes the rounding, and the needle's logprobs move. The needle's
prompt is long enough (several 16-token softmax blocks) for the split to matter.

Plain-text tables and a ``tqdm`` bar (already a dependency) rather than ``rich``: the output is a
handful of short tables, and ``--json`` serves machines.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from detspec.async_llm import AsyncLLM
from detspec.outputs import RequestOutput
from detspec.sampling_params import SamplingParams

NEEDLE_PROMPT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key "
    "function can be supplied to customize the sort order, and the reverse flag can be set to "
    "request the result in descending order."
)
# Background prompts: English openings of assorted lengths, cut at random word counts.
BACKGROUND = [
    "Create a new dictionary with keys from the iterable and values set to value.",
    "This module provides access to some objects used or maintained by the interpreter",
    "Open the file and return a stream. Raise an error upon failure.",
    "Return the number of items in a container, or raise a type error if",
    "The deque is a list-like sequence optimized for data accesses near its endpoints.",
    "Read and return up to n bytes from the underlying raw stream, blocking until",
    "Send a signal to the process group and wait for every child to exit before",
    "Convert a string to a floating point number, if possible, otherwise raise",
]
# (concurrent requests, seconds between arrivals)
ROUNDS = [(3, 0.0), (8, 0.002), (16, 0.005), (32, 0.001), (24, 0.01)]
QUICK_ROUNDS = [(3, 0.0), (8, 0.003)]
MODES = [
    # label, engine settings, whether the needle asks for determinism
    ("dvr", {"determinism": "dvr"}, True),
    ("dvr-replay", {"determinism": "dvr", "verify_strategy": "replay", "verify_window": 8}, True),
    ("off", {"determinism": "off"}, False),
]


@dataclass
class Round:
    n: int
    gap_ms: float
    needle_at: int
    tokens_equal: bool
    logprob_bits_equal: bool
    first_difference: int | None
    digest: str
    fingerprint: str
    generated_tokens: int
    seconds: float


@dataclass
class ModeResult:
    mode: str
    fingerprint: str
    solo_digest: str
    solo_text: str
    rounds: list[Round] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    tokens_per_second: float = 0.0

    @property
    def all_equal(self) -> bool:
        return all(r.tokens_equal and r.logprob_bits_equal for r in self.rounds)

    @property
    def differing_rounds(self) -> int:
        return sum(not (r.tokens_equal and r.logprob_bits_equal) for r in self.rounds)


def _bits(out: RequestOutput) -> tuple[list[int], list[bytes]]:
    c = out.outputs[0]
    lps = c.logprobs or []
    return list(c.token_ids), [
        struct.pack("<f", lp[t].logprob) for t, lp in zip(c.token_ids, lps, strict=True)
    ]


def _digest(bits: tuple[list[int], list[bytes]]) -> str:
    h = hashlib.sha256()
    for t, b in zip(*bits, strict=True):
        h.update(struct.pack("<I", t) + b)
    return h.hexdigest()[:12]


def _first_difference(a: tuple[list[int], list[bytes]], b: tuple[list[int], list[bytes]]) -> int:
    for i, (x, y) in enumerate(zip(zip(*a, strict=True), zip(*b, strict=True), strict=False)):
        if x != y:
            return i
    return min(len(a[0]), len(b[0]))


async def _run(engine: AsyncLLM, prompt: str, params: SamplingParams, rid: str) -> RequestOutput:
    last = None
    async for out in engine.generate(prompt, params, request_id=rid):
        last = out
    assert last is not None
    return last


async def _round(
    engine: AsyncLLM,
    needle: SamplingParams,
    n: int,
    gap: float,
    rng: np.random.Generator,
    deterministic_neighbours: bool,
    max_tokens: int,
    tag: str,
) -> tuple[RequestOutput, int, int]:
    """Submits n background requests `gap` seconds apart with the needle at a random slot."""
    needle_at = int(rng.integers(0, n + 1))
    tasks = []
    for i in range(n + 1):
        if i == needle_at:
            tasks.append(asyncio.create_task(_run(engine, NEEDLE_PROMPT, needle, f"{tag}-needle")))
        else:
            words = str(rng.choice(BACKGROUND)).split()
            prompt = " ".join(words[: int(rng.integers(3, len(words) + 1))])
            sp = SamplingParams(
                temperature=float(rng.choice([0.0, 0.7, 1.0])),
                seed=int(rng.integers(0, 2**31)),
                max_tokens=int(rng.integers(4, max_tokens + 1)),
                ignore_eos=True,
                deterministic=deterministic_neighbours and bool(rng.integers(0, 2)),
            )
            tasks.append(asyncio.create_task(_run(engine, prompt, sp, f"{tag}-bg{i}")))
        if gap:
            await asyncio.sleep(gap)
    outs = await asyncio.gather(*tasks)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs[needle_at], needle_at, generated


async def _throughput(engine: AsyncLLM, deterministic: bool, args: argparse.Namespace) -> float:
    """Output tokens per second of one offline batch (all submitted at once, half of them
    deterministic where the mode allows), best of a few repeats: the rounds above are too
    short and too timing-dependent to measure speed."""
    n, repeats = (16, 2) if args.quick else (32, 3)
    best = 0.0
    for rep in range(repeats):
        params = [
            SamplingParams(
                temperature=0.8,
                seed=i,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                deterministic=deterministic and i % 2 == 0,
            )
            for i in range(n)
        ]
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(_run(engine, BACKGROUND[i % len(BACKGROUND)], sp, f"tp{rep}-{i}")
              for i, sp in enumerate(params))
        )  # fmt: skip
        dt = time.perf_counter() - t0
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    return best


async def _run_mode(
    model: str | None,
    label: str,
    settings: dict[str, Any],
    deterministic: bool,
    rounds: list[tuple[int, float]],
    args: argparse.Namespace,
    bar: Any,
) -> ModeResult:
    engine = AsyncLLM(model, **settings)
    try:
        needle = SamplingParams(
            temperature=args.temperature,
            seed=args.seed,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            logprobs=0,
            deterministic=deterministic,
        )
        solo_out = await _run(engine, NEEDLE_PROMPT, needle, f"{label}-solo")
        solo = _bits(solo_out)
        res = ModeResult(label, engine.fingerprint, _digest(solo), solo_out.outputs[0].text)
        bar.update(1)
        before = engine.stats()
        rng = np.random.default_rng(args.seed)  # the same rounds in every mode
        for i, (n, gap) in enumerate(rounds):
            t0 = time.perf_counter()
            out, at, tokens = await _round(
                engine, needle, n, gap, rng, deterministic, args.max_tokens, f"{label}-r{i}"
            )
            dt = time.perf_counter() - t0
            got = _bits(out)
            res.rounds.append(
                Round(
                    n=n,
                    gap_ms=gap * 1e3,
                    needle_at=at,
                    tokens_equal=got[0] == solo[0],
                    logprob_bits_equal=got[1] == solo[1],
                    first_difference=None if got == solo else _first_difference(got, solo),
                    digest=_digest(got),
                    fingerprint=out.fingerprint,
                    generated_tokens=tokens,
                    seconds=round(dt, 3),
                )
            )
            bar.update(1)
        after = engine.stats()
        res.stats = {k: after[k] - before.get(k, 0) for k in after}
        res.tokens_per_second = await _throughput(engine, deterministic, args)
        bar.update(1)
        return res
    finally:
        engine.shutdown()


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        s.rstrip() for s in [fmt.format(*headers), line, *(fmt.format(*r) for r in rows)]
    )


def _yes(b: bool) -> str:
    return "yes" if b else "NO"


def render(results: list[ModeResult], rounds: list[tuple[int, float]]) -> str:
    """Human-readable report: one table per round (a row per mode), counters, verdict."""
    out = [f'needle: "{NEEDLE_PROMPT[:60]}..."']
    for r in results:
        out.append(f"  {r.mode:<10} alone -> digest {r.solo_digest}: {r.solo_text[:60]!r}...")
    for i, (n, gap) in enumerate(rounds):
        rows = []
        for r in results:
            rd = r.rounds[i]
            rows.append(
                [
                    r.mode,
                    _yes(rd.tokens_equal),
                    _yes(rd.logprob_bits_equal),
                    "-" if rd.first_difference is None else str(rd.first_difference),
                    rd.digest,
                    rd.fingerprint,
                ]
            )
        out.append("")
        first = results[0].rounds[i]
        out.append(
            f"round {i + 1}: needle + {n} concurrent requests, {gap * 1e3:g} ms apart "
            f"(needle arrives #{first.needle_at + 1})"
        )
        out.append(
            _table(
                [
                    "mode",
                    "tokens equal",
                    "logprob bits equal",
                    "first diff",
                    "digest",
                    "fingerprint",
                ],
                rows,
            )
        )
    out.append("")
    base = next((r for r in results if r.mode == "off"), None)
    rows = []
    for r in results:
        cost = "-"
        if base is not None and r is not base and base.tokens_per_second:
            cost = f"{r.tokens_per_second / base.tokens_per_second:.2f}x"
        rows.append(
            [
                r.mode,
                str(r.stats.get("num_verify_passes", 0)),
                str(r.stats.get("num_rollbacks", 0)),
                str(r.stats.get("num_rolled_back_tokens", 0)),
                f"{r.tokens_per_second:.0f}",
                cost,
            ]
        )
    out.append(
        "engine counters over the rounds; throughput of an offline batch "
        "(half deterministic where allowed):"
    )
    out.append(
        _table(
            ["mode", "verify passes", "rollbacks", "rolled-back tokens", "tok/s", "vs off"],
            rows,
        )
    )
    out.append(
        "  (dvr on CPU computes deterministic rows inline on the fixed-schedule kernels: nothing "
        "to replay;\n   dvr-replay decodes on the fast path and verifies every 8 tokens. "
        "Throughput here is a short,\n   noisy run of a tiny model; docs/performance.md has "
        "the measured cost.)"
    )
    out.append("")
    out.append(verdict(results))
    return "\n".join(out)


def verdict(results: list[ModeResult]) -> str:
    lines = []
    for r in results:
        total = len(r.rounds)
        if r.mode == "off":
            lines.append(
                f"off: the same request differed from its solo run in {r.differing_rounds} of "
                f"{total} rounds"
                + (
                    " -- batching changes the bits, as expected without DVR"
                    if r.differing_rounds
                    else " -- the control saw no variance this time (the check above is blind)"
                )
            )
        else:
            lines.append(
                f"{r.mode}: bitwise identical to the solo run in {total - r.differing_rounds} of "
                f"{total} rounds" + (" -- contract held" if r.all_equal else " -- CONTRACT BROKEN")
            )
    return "verdict:\n  " + "\n  ".join(lines)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF model directory (default: the built-in model, detspec-tiny-en)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"reduced form for CI: {len(QUICK_ROUNDS)} rounds instead of {len(ROUNDS)}, "
        "shorter outputs",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens the needle generates (default 48, 24 with --quick); background requests "
        "generate 4 to this many",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="the needle's sampling temperature (default 0.8; 0 = greedy)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="the needle's sampling seed, also seeds the background requests and arrivals",
    )
    p.add_argument(
        "--modes",
        default=",".join(m[0] for m in MODES),
        help="comma-separated modes to run: dvr (engine default: determinism='dvr'), "
        "dvr-replay (verify_strategy='replay', window 8: shows verify passes and rollbacks), "
        "off (determinism='off', the negative control)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON document instead of the tables"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_demo(args: argparse.Namespace) -> int:
    """Runs the demo; exit status 1 if a deterministic request ever differed."""
    from tqdm import tqdm

    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    if args.max_tokens is None:
        args.max_tokens = 24 if args.quick else 48
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    known = {m[0]: m for m in MODES}
    unknown = [m for m in wanted if m not in known]
    if unknown or not wanted:
        print(
            f"error: invalid parameter `--modes`: unknown {unknown} (choose from {list(known)})",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    results = []
    with tqdm(
        total=len(wanted) * (len(rounds) + 2),
        desc="demo",
        unit="run",
        disable=args.no_progress or args.json,
        file=sys.stderr,
    ) as bar:
        for label in wanted:
            _, settings, det = known[label]
            bar.set_description(label)
            results.append(
                asyncio.run(_run_mode(args.model, label, settings, det, rounds, args, bar))
            )
    wall = time.perf_counter() - t0
    ok = all(r.all_equal for r in results if r.mode != "off")
    if args.json:
        doc = {
            "model": os.fspath(args.model) if args.model else "built-in",
            "needle_prompt": NEEDLE_PROMPT,
            "rounds": [{"n": n, "gap_ms": g * 1e3} for n, g in rounds],
            "modes": [
                {**asdict(r), "all_equal": r.all_equal, "differing_rounds": r.differing_rounds}
                for r in results
            ],
            "deterministic_all_equal": ok,
            "off_differs": any(r.differing_rounds for r in results if r.mode == "off"),
            "wall_seconds": round(wall, 2),
        }
        print(json.dumps(doc, indent=2))
    else:
        print(render(results, rounds))
        print(f"\n({wall:.1f} s)")
    return 0 if ok else 1
