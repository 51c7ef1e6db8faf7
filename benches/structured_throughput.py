"""End-to-end cost of structured outputs: a batch of N JSON-schema requests against the same
batch unconstrained, alternating, on the bench model of docs/architecture.md.

N random 128-token prompts -> 64 tokens each (greedy, ``ignore_eos``: every request produces
all 64, and after its JSON closes the grammar allows only EOS, which still costs a mask per
step), after a warm-up of each kind. Prints output tokens/s per round and the ratio.

    python benches/structured_throughput.py 64 --rounds 2
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from bench_model import bench_model

from detspec import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}


def main(argv: list[str]) -> None:
    model = str(bench_model(os.environ.get("DETSPEC_BENCH_MODEL", "/tmp/benchmodel"), "bench"))
    n = int(argv[0])
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
    llm = LLM(model)
    rng = np.random.default_rng(0)
    plain = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=64,
        temperature=0.0,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )

    def batch() -> list[list[int]]:
        return [[int(x) for x in rng.integers(3, 4000, 128)] for _ in range(n)]

    def run(params: SamplingParams) -> float:
        prompts = batch()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt

    run(plain)
    run(constrained)
    for r in range(rounds):
        load = os.getloadavg()[0]
        a = run(plain)
        b = run(constrained)
        print(
            f"round {r} n={n} unconstrained {a:.1f} tok/s, json_schema {b:.1f} tok/s, "
            f"ratio {b / a:.3f} (load {load:.2f})"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
