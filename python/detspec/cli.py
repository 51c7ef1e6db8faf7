"""``detspec`` command line: ``generate`` from a model directory (or the built-in default
model), ``serve`` an OpenAI-compatible server, ``run-batch`` a file of OpenAI batch requests,
``bench serve`` a running server, ``demo`` the determinism contract on the built-in model."""

from __future__ import annotations

import argparse
import sys

from detspec.errors import DetspecError
from detspec.llm import LLM
from detspec.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="detspec", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts")
    g.add_argument(
        "--model", default=None, help="HF model directory (default: the built-in default model)"
    )
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)

    # The server and the benchmark import their dependencies only when run.
    from detspec.bench import add_bench_arguments
    from detspec.server.run_batch import add_run_batch_arguments
    from detspec.server.serve_flags import add_serve_arguments

    s = sub.add_parser("serve", help="run the OpenAI-compatible server (needs detspec[serve])")
    add_serve_arguments(s)
    add_run_batch_arguments(
        sub.add_parser(
            "run-batch",
            help="answer a file of OpenAI batch requests offline (vLLM's run_batch; needs "
            "detspec[serve])",
        )
    )
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    add_bench_arguments(
        bsub.add_parser("serve", help="load a running server through HTTP, as vllm bench serve")
    )
    from detspec.demo import add_demo_arguments

    add_demo_arguments(
        sub.add_parser(
            "demo",
            help="watch a deterministic request stay bitwise identical under concurrent load "
            "(and the same request drift with determinism off)",
            description="One deterministic request alone, then inside rounds of concurrent "
            "random requests, then the same under determinism='off'; tables of what changed. "
            "Exit status 1 if a deterministic request ever differed from its solo run.",
        )
    )
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        from detspec.demo import run_demo

        return run_demo(args)
    if args.cmd == "serve":
        from detspec.server.serve import serve

        return serve(args)
    if args.cmd == "run-batch":
        from detspec.server.run_batch import run_batch

        return run_batch(args)
    if args.cmd == "bench":
        from detspec.bench import bench_serve

        return bench_serve(args)
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    prompts = args.prompt or ["Deterministic inference means", "The quick brown fox"]
    try:
        llm = LLM(args.model)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        outs = llm.generate(prompts, params)
    except DetspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for o in outs:
        c = o.outputs[0]
        print(f"prompt: {o.prompt!r}")
        print(f"  output: {c.text!r}")
        print(
            f"  tokens: {len(c.token_ids)}  finish: {c.finish_reason}  "
            f"cumulative logprob: {c.cumulative_logprob:.4f}"
        )
    print(f"fingerprint: {llm.fingerprint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
