"""A real-size model on the CPU: load time, peak RSS, batch-1 decode against the memory-bandwidth
bound, batch-16 throughput (issue 24). A benchmark, not a test.

Write the model first (random weights, no download; ~16 GB for the 8B shape in bfloat16;
13.8 GB for gpt-oss-20b's with its experts in MXFP4):

    python benches/write_random_llama.py --shape llama3-8b --streaming --out /tmp/llama3-8b-bf16
    python benches/big_model.py /tmp/llama3-8b-bf16 --out /tmp/big-model.json
    python benches/write_random_gpt_oss.py --out /tmp/gpt-oss-20b-mxfp4
    python benches/big_model.py /tmp/gpt-oss-20b-mxfp4 --out /tmp/gpt-oss.json

Steps: (1) the memory bandwidth of this machine, measured (numpy sums over a 1 GiB array,
best of 5, one thread; and 2 threads via two processes); (2) ``LLM(model, dtype=...)`` timed
(the weights are read from the memory-mapped safetensors and packed), peak RSS after it
(``ru_maxrss``) and the resident set now; (3) batch 1: one 32-token prompt, ``--tokens``
greedy tokens, decode tok/s = (tokens - 1) / (time of the full generate - time of a 1-token
generate of the same prompt); bound = bandwidth / bytes of weights read per token (every
linear layer and the LM head; one embedding row); (4) batch 16: 16 prompts, total output
tok/s of the generate, and decode tok/s = 16 (tokens - 1) / (its time - a 1-token
generate's). Load average recorded with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def bandwidth_one_thread(gib: float = 1.0, reps: int = 5) -> float:
    a = np.ones(int(gib * (1 << 30)) // 4, dtype=np.float32)
    a.sum()  # touch
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def bandwidth_two_processes() -> float:
    here = str(Path(__file__).parent)
    code = (
        f"import sys; sys.path.insert(0, {here!r}); import big_model; "
        "print(big_model.bandwidth_one_thread())"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    return sum(float(p.communicate()[0].strip()) for p in procs)


def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def weight_bytes_per_token(cfg: dict, itemsize: int, kept: str | None = None) -> int:
    """Bytes of weights one token reads: of a mixture of experts (every layer sparse), the
    router and the ``num_experts_per_tok`` experts it runs. Quantized weights the engine keeps
    so (``kept``; on the CPU, but on AMX tiles): MXFP4 experts at 17 bytes a 32 weights, an
    FP8 checkpoint's layer matrices at a byte a weight (their scales, 4 bytes a 16 K block,
    left out)."""
    hs, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or hs // cfg["num_attention_heads"]
    h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    layer_bytes = 1 if kept == "fp8" else itemsize
    expert_bytes = 17 / 32 if kept == "mxfp4" else layer_bytes
    if experts:
        width = cfg.get("moe_intermediate_size", inter)
        mlp = experts * hs * itemsize + cfg["num_experts_per_tok"] * 3 * hs * width * expert_bytes
    else:
        mlp = 3 * hs * inter * layer_bytes
    per_layer = (hs * h * d * 2 + hs * kvh * d * 2) * layer_bytes + mlp
    return int(cfg["num_hidden_layers"] * per_layer + (vocab * hs + hs) * itemsize)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--activation-dtype", default="auto")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kv-pages", type=int, default=512)
    p.add_argument("--skip-bandwidth", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from detspec import LLM, SamplingParams

    res: dict = {"model": str(args.model), "load_start": os.getloadavg()[0]}
    if not args.skip_bandwidth:
        res["bandwidth_1t_GBps"] = bandwidth_one_thread() / 1e9
        res["bandwidth_2p_GBps"] = bandwidth_two_processes() / 1e9
        print(
            f"bandwidth {res['bandwidth_1t_GBps']:.1f} GB/s (1 thread), "
            f"{res['bandwidth_2p_GBps']:.1f} GB/s (2 processes)",
            flush=True,
        )
    cfg = json.loads((args.model / "config.json").read_text())
    t = time.perf_counter()
    llm = LLM(
        str(args.model),
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        activation_dtype=args.activation_dtype,
        num_kv_pages=args.kv_pages,
        enable_prefix_caching=False,
    )
    res["load_s"] = time.perf_counter() - t
    res["peak_rss_after_load_GiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    res["rss_after_load_GiB"] = rss_now() / 2**30
    res["fingerprint"] = llm.fingerprint
    print(
        f"load {res['load_s']:.1f} s, peak RSS {res['peak_rss_after_load_GiB']:.2f} GiB, "
        f"RSS {res['rss_after_load_GiB']:.2f} GiB, load avg {os.getloadavg()[0]:.2f}",
        flush=True,
    )

    rng = np.random.default_rng(0)
    vocab = cfg["vocab_size"]
    prompt = [int(x) for x in rng.integers(3, vocab - 1, 32)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], one, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    t_prefill = time.perf_counter() - t
    t = time.perf_counter()
    out = llm.generate([prompt], full, use_tqdm=False)[0]
    t_full = time.perf_counter() - t
    n = len(out.outputs[0].token_ids)
    res["b1_prefill_s"] = t_prefill
    res["b1_decode_tok_s"] = (n - 1) / (t_full - t_prefill)
    res["b1_tokens"] = out.outputs[0].token_ids
    res["b1_load"] = os.getloadavg()[0]
    itemsize = 2 if "bf16" in llm.fingerprint.split("-") else 4
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    kept = {"mxfp4": "mxfp4", "fp8": "fp8", "compressed-tensors": "fp8"}.get(method)
    if "abf16amx" in llm.fingerprint:
        kept = None
    res["weight_bytes_per_token"] = weight_bytes_per_token(cfg, itemsize, kept)
    if "bandwidth_2p_GBps" in res:
        bound = res["bandwidth_2p_GBps"] * 1e9 / res["weight_bytes_per_token"]
        res["b1_bound_tok_s"] = bound
        res["b1_fraction_of_bound"] = res["b1_decode_tok_s"] / bound
    print(
        f"batch 1: decode {res['b1_decode_tok_s']:.2f} tok/s "
        f"(bound {res.get('b1_bound_tok_s', float('nan')):.2f}), prefill of 32 "
        f"{t_prefill:.1f} s, load avg {res['b1_load']:.2f}",
        flush=True,
    )

    prompts = [[int(x) for x in rng.integers(3, vocab - 1, 32)] for _ in range(args.batch)]
    t = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    res["bN_prefill_s"] = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.generate(prompts, full, use_tqdm=False)
    dt = time.perf_counter() - t
    res["bN_decode_tok_s"] = args.batch * (args.tokens - 1) / (dt - res["bN_prefill_s"])
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    res["batch"] = args.batch
    res["bN_tok_s"] = toks / dt
    res["bN_s"] = dt
    res["bN_load"] = os.getloadavg()[0]
    res["peak_rss_end_GiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"batch {args.batch}: {res['bN_tok_s']:.2f} output tok/s over {dt:.1f} s "
        f"(32-token prompts, {args.tokens} tokens each, prefill included; prefill alone "
        f"{res['bN_prefill_s']:.1f} s, decode {res['bN_decode_tok_s']:.2f} tok/s), "
        f"peak RSS {res['peak_rss_end_GiB']:.2f} GiB, load avg {res['bN_load']:.2f}",
        flush=True,
    )
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
