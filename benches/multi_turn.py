"""Multi-turn conversations: each turn's prompt is the conversation so far (every earlier
prompt and answer) plus a new message, as chat clients and agent loops (a tool result after
each call) send it. Times the whole run and counts the prompt tokens read from the prefix
cache against those computed.

C conversations run side by side, turn by turn (one ``generate`` call per turn); the first
prompt is a shared system prompt plus a message. Answers are sampled (seed per
conversation, ``ignore_eos``) so they differ between conversations.

    python benches/multi_turn.py                         # bench model, plain requests
    python benches/multi_turn.py --deterministic
    python benches/multi_turn.py --conversations 8 --turns 4 --message-len 64 --answer-len 128
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from bench_model import bench_model, vocab_size

from detspec import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", choices=["bench", "tiny"], default="bench")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--message-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=128)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()

    model_dir = bench_model(args.model_dir, args.model)
    vocab = vocab_size(model_dir)
    llm = LLM(str(model_dir))
    for run in range(args.runs):
        llm.reset_prefix_cache()
        rng = np.random.default_rng(run)

        def tokens(n: int, rng: np.random.Generator = rng) -> list[int]:
            return [int(x) for x in rng.integers(3, vocab, n)]

        system = tokens(args.system_len)
        convs = [system + tokens(args.message_len) for _ in range(args.conversations)]
        read = computed = 0
        t0 = time.perf_counter()
        for turn in range(args.turns):
            params = [
                SamplingParams(
                    temperature=1.0,
                    seed=1000 * turn + i,
                    max_tokens=args.answer_len,
                    ignore_eos=True,
                    deterministic=args.deterministic,
                )
                for i in range(args.conversations)
            ]
            outs = llm.generate(convs, params, use_tqdm=False)
            for i, o in enumerate(outs):
                read += o.num_cached_tokens
                computed += len(o.prompt_token_ids) - o.num_cached_tokens
                convs[i] = convs[i] + list(o.outputs[0].token_ids) + tokens(args.message_len)
        dt = time.perf_counter() - t0
        answered = args.conversations * args.turns * args.answer_len
        print(
            f"run {run}: {args.conversations} conversations x {args.turns} turns, "
            f"det={args.deterministic}: {dt:.2f} s, {answered / dt:.1f} answer tok/s; "
            f"prompt tokens read from cache {read}, computed {computed}; "
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
