"""GPU benchmarks in one process (one device call): a Llama-3.1-8B-shaped bf16 model with
random weights (``write_random_llama.py``), loaded once per engine mode.

Parts (``--parts``, in this order; the JSON is rewritten after each, so a run cut short keeps
what it measured):

* ``bandwidth``: the GPU's device-to-device copy bandwidth (bytes read + written), and from it
  the batch-1 decode bound: bandwidth / bytes of weights read per token (every matrix but the
  embedding, of which a token reads one row).
* ``decode``: batch-1 decode tok/s (128-token prompt; time of 129 tokens minus time of 1, so
  the prefill is left out; after one untimed run, the median of three), as a fraction of that
  bound; ``determinism="dvr"``, a
  non-deterministic request.
* ``offline``: output tok/s at batch 1/16/64 (128-token random prompts -> 128 greedy tokens,
  ``ignore_eos``).
* ``sampled``: the same batches sampled as RL rollouts and evals do (T = 1; T = 0.6 with
  top-p 0.95; seeded), next to ``offline``'s greedy rows: what the host sampler costs per step
  (its rows run in parallel on the host after the logits are copied back).
* ``invariant``: ``--num-requests`` requests at once on the dvr engine (none deterministic),
  then the same in ``determinism="batch_invariant"`` (a second engine: every GEMM in 16-row
  blocks), and the ratio.
* ``hf``: transformers ``generate`` at batch 1/16/64 on the same GPU (bf16, greedy, 128-token
  prompts, ``--hf-new-tokens`` new tokens, ``min_new_tokens`` so none stops early).
* ``dvr``: ``--num-requests`` requests at once at 0/2/10/50/100 %
  ``deterministic=True`` (0 % first and last; the reference is their mean), relative
  throughput next to LLM-42's 0.99/0.96/0.87/0.78 (W = 64, B = 8), with verify passes,
  rollbacks per verify pass and per 1,000 deterministic tokens, recomputed tokens, and the
  steps' time by phase; fixed windows (``verify_window_adaptive=False``, LLM-42's protocol)
  unless ``--verify-window-adaptive``.
* ``scoring``: deterministic prompt logprobs (an eval harness's loglikelihood requests) of
  ``--num-requests`` prompts in one call, in the shapes a deterministic generation runs at
  (prefill passes of W rows, verify passes of B x W rows, several prompts to a pass), next to
  generating one token from each prompt; then, with the prefix cache emptied before each,
  lm-eval's request (``prompt_logprobs=1`` with ``max_tokens=1``: the generation reads the
  scored prompt's pages) and ``score`` of 32 tokens a deterministic generation just sampled
  (it reads the generated prompts' pages), with the prompt tokens read from the cache.
* ``dvr_adaptive``: the same at ``--adaptive-shares`` on a second engine with
  ``verify_window_adaptive=True`` (shorter windows after rollbacks), relative to the ``dvr``
  part's 0 % reference (measured here too when that part did not run).
* ``dvr_groups`` (last; not in the default parts): the ``dvr`` part at ``--group-shares`` on
  engines with ``verify_group`` B in ``--groups``: a pass is B x W rows whatever it carries,
  so fewer windows a pass cost less where few requests are deterministic (on the CPU's
  shape-dependent profile B = 1 measured 1.4-1.8x B = 8 at every share), until a pass's rows
  no longer ride on the weights' read.

    python benches/write_random_llama.py --shape llama3-8b --out /tmp/llama3-8b
    python benches/gpu_bench.py --model-dir /tmp/llama3-8b --out gpu_bench.json

``--device cpu`` runs the engine parts on the CPU (no ``bandwidth`` or ``hf``): a dry run of
the script on a small model before spending GPU time on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

LLM42 = {2: 0.99, 10: 0.96, 50: 0.87, 100: 0.78}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--parts",
        default="bandwidth,decode,offline,sampled,invariant,hf,dvr,scoring,dvr_adaptive",
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--shares", default="0,2,10,50,100")
    p.add_argument("--adaptive-shares", default="2,10,100")
    p.add_argument("--groups", default="1,2,4", help="B of the dvr_groups part's engines")
    p.add_argument("--group-shares", default="2,10,100")
    p.add_argument("--hf-new-tokens", type=int, default=32)
    p.add_argument("--num-kv-pages", type=int, default=8192)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="size the KV pool as vLLM does (this share of the GPU's memory, less the weights "
        "and a forward's headroom) instead of --num-kv-pages",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument(
        "--verify-group",
        type=int,
        default=8,
        help="B: windows per verify pass, every pass B x W rows (LLM-42: 8). Fewer rows a pass "
        "cost less where few requests are deterministic, more passes where many are",
    )
    p.add_argument(
        "--verify-window-adaptive",
        action="store_true",
        help="the first engine with shorter verify windows after rollbacks (the engine's "
        "default; without this flag it runs fixed windows)",
    )
    return p.parse_args()


class Results:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1))
        print(f"[{key}] {json.dumps(value)}", flush=True)


def weight_bytes(model_dir: Path) -> tuple[int, int]:
    """(all parameter bytes, bytes read per decoded token: all but the embedding)."""
    index = model_dir / "model.safetensors.index.json"
    total = json.loads(index.read_text())["metadata"]["total_size"]
    cfg = json.loads((model_dir / "config.json").read_text())
    embed = cfg["vocab_size"] * cfg["hidden_size"] * 2
    tied = cfg.get("tie_word_embeddings", False)
    return total, total - (0 if tied else embed)


def bandwidth(torch) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * reps / dt / 1e9


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, vocab - 1, length)] for _ in range(n)]


def timed_generate(llm, batch, params) -> tuple[float, int]:
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def phases(before: dict, after: dict) -> dict:
    """Per-step milliseconds by phase between two ``llm.stats()`` (forward: issuing the kernels;
    sample: waiting for them, copying logits, sampling; verify: verify passes)."""
    steps = max(1, after["num_steps"] - before["num_steps"])
    return {
        "steps": after["num_steps"] - before["num_steps"],
        **{
            f"{k}_ms_per_step": round(
                1000 * (after[f"time_{k}_s"] - before[f"time_{k}_s"]) / steps, 3
            )
            for k in ("forward", "sample", "verify")
        },
    }


def engine(
    args,
    determinism: str = "dvr",
    adaptive: bool | None = None,
    prefix_caching: bool = False,
    verify_group: int | None = None,
):
    from detspec import LLM

    t = time.perf_counter()
    llm = LLM(
        str(args.model_dir),
        device=args.device,
        determinism=determinism,
        num_kv_pages=None if args.gpu_memory_utilization else args.num_kv_pages,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=prefix_caching,
        verify_window_adaptive=args.verify_window_adaptive if adaptive is None else adaptive,
        verify_group=args.verify_group if verify_group is None else verify_group,
    )
    return llm, time.perf_counter() - t


def dvr_shares(
    args, res: Results, llm, vocab: int, shares: list[int], key: str, base: float | None = None
) -> float:
    """Throughput at each deterministic share, relative to `base` or, without one, to 0 %
    (run first and last); returns the reference."""
    from detspec import SamplingParams

    n = args.num_requests
    if base is None and shares[0] != 0:
        shares = [0, *shares]
    if shares[0] == 0:
        shares = shares + [0]

    def run_share(share: int, seed: int) -> dict:
        batch = prompts(n, args.prompt_len, 1000 + seed, vocab)
        k = round(n * share / 100)
        det = set(np.random.default_rng(seed).choice(n, size=k, replace=False).tolist())
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=args.output_len,
                ignore_eos=True,
                deterministic=i in det,
            )
            for i in range(n)
        ]
        before = llm.stats()
        dt, toks = timed_generate(llm, batch, params)
        after = llm.stats()
        delta = {key: after[key] - before.get(key, 0) for key in after}
        passes = max(1, delta.get("num_verify_passes", 0))
        return {
            "share": share,
            "deterministic_requests": k,
            "tok_s": round(toks / dt, 1),
            "seconds": round(dt, 2),
            "verify_passes": delta.get("num_verify_passes", 0),
            "rollbacks": delta.get("num_rollbacks", 0),
            "rolled_back_tokens": delta.get("num_rolled_back_tokens", 0),
            "recomputed_share": round(delta.get("num_rolled_back_tokens", 0) / toks, 4),
            "rollbacks_per_pass": round(delta.get("num_rollbacks", 0) / passes, 4),
            "rollbacks_per_1k_det_tokens": round(
                1000 * delta.get("num_rollbacks", 0) / max(1, k * args.output_len), 3
            ),
            "phases": phases(before, after),
        }

    rows = []
    for i, share in enumerate(shares):
        rows.append(run_share(share, i))
        res.put(f"{key}_{i}_{share}", rows[-1])
    if base is None:
        ref = [r["tok_s"] for r in rows if r["share"] == 0]
        base = sum(ref) / len(ref)
    for r in rows:
        r["relative"] = round(r["tok_s"] / base, 3)
        r["llm42"] = LLM42.get(r["share"])
    res.put(key, {"reference_tok_s": round(base, 1), "rows": rows})
    return base


def hf_generate(args, res: Results, torch, vocab: int) -> None:
    """transformers ``generate`` on the same GPU, greedy, ``min_new_tokens`` = max."""
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model_dir), dtype=torch.bfloat16, device_map="cuda"
    )
    rows: dict = {"load_s": round(time.perf_counter() - t, 1)}
    new = args.hf_new_tokens
    for n in [int(x) for x in args.batches.split(",")]:
        ids = torch.tensor(prompts(n, args.prompt_len, 10 + n, vocab), device="cuda")
        kw = dict(
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
        )
        model.generate(ids[:, :16], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        toks = (out.shape[1] - ids.shape[1]) * n
        rows[n] = {"tok_s": round(toks / dt, 1), "seconds": round(dt, 2)}
        res.put(f"hf_{n}", rows[n])
    res.put("hf", rows)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    args = parse_args()
    parts = set(args.parts.split(","))
    if args.device == "cpu":
        parts -= {"bandwidth", "hf"}
    res = Results(args.out)
    import torch

    from detspec import SamplingParams

    cfg = json.loads((args.model_dir / "config.json").read_text())
    vocab = cfg["vocab_size"]
    on_gpu = args.device == "cuda"
    res.put(
        "gpu",
        {
            "name": torch.cuda.get_device_name(0) if on_gpu else "cpu",
            "driver": os.popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader")
            .read()
            .strip()
            if on_gpu
            else None,
            "model": str(args.model_dir),
            "load_avg": os.getloadavg(),
        },
    )
    bound = None
    if "bandwidth" in parts:
        total, per_token = weight_bytes(args.model_dir)
        bw = bandwidth(torch)
        bound = bw * 1e9 / per_token
        res.put(
            "bandwidth",
            {
                "copy_GBps": round(bw, 1),
                "weight_bytes": total,
                "bytes_per_token": per_token,
                "decode_bound_tok_s": round(bound, 1),
            },
        )

    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = None
    if parts & {"decode", "offline", "sampled", "invariant", "dvr", "scoring"}:
        llm, load_s = engine(args)
        free_pages, total_pages = llm.kv_pages()
        res.put(
            "engine",
            {
                "load_s": round(load_s, 2),
                "fingerprint": llm.fingerprint,
                "kv_pages": total_pages,
                "gpu_memory_utilization": args.gpu_memory_utilization,
            },
        )
        llm.generate(prompts(4, 64, 99, vocab), warm, use_tqdm=False)

    if "decode" in parts:
        p = prompts(1, args.prompt_len, 1, vocab)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True)
        # The prompt's prefill once before timing: the first prefill of a shape pays for
        # cuBLAS's choice of kernels, and inside the 1-token run it made that round's rate ~2 %
        # too high (the rate subtracts the 1-token run). Taken as the median of the runs.
        timed_generate(llm, p, one)
        runs = []
        for _ in range(3):
            t1, _ = timed_generate(llm, p, one)
            before = llm.stats()
            t129, _ = timed_generate(llm, p, many)
            split = phases(before, llm.stats())
            runs.append(128 / (t129 - t1))
        rate = statistics.median(runs)
        res.put(
            "decode_batch1",
            {
                "tok_s_runs": [round(r, 1) for r in runs],
                "tok_s": round(rate, 1),
                "fraction_of_bound": round(rate / bound, 3) if bound else None,
                "ms_per_token": round(1000 / rate, 2),
                "phases": split,
            },
        )

    if "offline" in parts:
        rows = {}
        for n in [int(x) for x in args.batches.split(",")]:
            before = llm.stats()
            dt, toks = timed_generate(llm, prompts(n, args.prompt_len, 10 + n, vocab), greedy)
            rows[n] = {
                "tok_s": round(toks / dt, 1),
                "seconds": round(dt, 2),
                "tokens": toks,
                "phases": phases(before, llm.stats()),
            }
            res.put(f"offline_{n}", rows[n])
        res.put("offline", rows)

    if "sampled" in parts:
        settings = {
            "t1": {"temperature": 1.0},
            "t0.6_p0.95": {"temperature": 0.6, "top_p": 0.95},
        }
        rows = {}
        for name, kw in settings.items():
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=0, **kw)
            for n in [int(x) for x in args.batches.split(",")]:
                before = llm.stats()
                dt, toks = timed_generate(llm, prompts(n, args.prompt_len, 10 + n, vocab), params)
                rows[f"{name}_{n}"] = {
                    "tok_s": round(toks / dt, 1),
                    "seconds": round(dt, 2),
                    "phases": phases(before, llm.stats()),
                }
                res.put(f"sampled_{name}_{n}", rows[f"{name}_{n}"])
        res.put("sampled", rows)

    n = args.num_requests
    if "invariant" in parts:
        # The same workload on the dvr engine (no deterministic request), then in
        # batch_invariant mode (a second engine: every GEMM in 16-row blocks).
        batch = prompts(n, args.prompt_len, 1000, vocab)
        dt, toks = timed_generate(llm, batch, greedy)
        inv, load_s = engine(args, "batch_invariant")
        inv.generate(prompts(4, 64, 99, vocab), warm, use_tqdm=False)
        dt_inv, toks_inv = timed_generate(inv, batch, greedy)
        res.put(
            "batch_invariant",
            {
                "dvr_0pct_tok_s": round(toks / dt, 1),
                "tok_s": round(toks_inv / dt_inv, 1),
                "relative": round((toks_inv / dt_inv) / (toks / dt), 3),
                "load_s": round(load_s, 2),
            },
        )
        inv.shutdown()
        del inv
        gc.collect()

    if "hf" in parts:
        hf_generate(args, res, torch, vocab)

    base = None
    if "dvr" in parts:
        shares = [int(x) for x in args.shares.split(",")]
        base = dvr_shares(args, res, llm, vocab, shares, "dvr")

    if "scoring" in parts:
        batch = prompts(n, args.prompt_len, 2000, vocab)
        llm.prompt_logprobs(batch[:4], 1)  # warm-up
        t = time.perf_counter()
        llm.prompt_logprobs(batch, 1)
        dt = time.perf_counter() - t
        dt_gen, _ = timed_generate(
            llm, batch, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        )
        # The same engine with a prefix cache, for what shares pages (one engine at a time:
        # an 8B model's weights twice may not fit).
        llm.shutdown()
        del llm
        gc.collect()
        llm, _ = engine(args, prefix_caching=True)
        llm.prompt_logprobs(batch[:4], 1)  # warm-up
        llm.reset_prefix_cache()
        hits = llm.kv_stats()["prefix_hits"]
        loglikelihood = SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1, deterministic=True
        )
        dt_eval, _ = timed_generate(llm, batch, loglikelihood)
        eval_hits = llm.kv_stats()["prefix_hits"] - hits
        llm.reset_prefix_cache()
        rollout = SamplingParams(
            temperature=0.8, seed=1, max_tokens=32, ignore_eos=True, deterministic=True
        )
        outs = llm.generate(batch, rollout, use_tqdm=False)
        hits = llm.kv_stats()["prefix_hits"]
        t = time.perf_counter()
        llm.score(batch, [list(o.outputs[0].token_ids) for o in outs], deterministic=True)
        dt_score = time.perf_counter() - t
        res.put(
            "scoring",
            {
                "prompts": n,
                "prompt_len": args.prompt_len,
                "prompt_logprobs_s": round(dt, 3),
                "prompts_per_s": round(n / dt, 1),
                "generate_1_token_s": round(dt_gen, 3),
                "eval_loglikelihood_s": round(dt_eval, 3),
                "eval_prefix_hit_tokens": int(eval_hits),
                "score_after_generate_s": round(dt_score, 3),
                "score_prefix_hit_tokens": int(llm.kv_stats()["prefix_hits"] - hits),
            },
        )

    if llm is not None:
        if on_gpu:
            # What the whole GPU holds with the first engine still alive (its pool, weights and
            # workspace), as the driver counts it: the check of gpu_memory_utilization's
            # headroom estimate.
            free, total = torch.cuda.mem_get_info()
            res.put(
                "gpu_memory",
                {
                    "used_GiB": round((total - free) / 2**30, 2),
                    "total_GiB": round(total / 2**30, 2),
                },
            )
        llm.shutdown()
        del llm
        gc.collect()

    if "dvr_adaptive" in parts:
        adaptive, _ = engine(args, adaptive=True)
        adaptive.generate(prompts(4, 64, 99, vocab), warm, use_tqdm=False)
        shares = [int(x) for x in args.adaptive_shares.split(",")]
        dvr_shares(args, res, adaptive, vocab, shares, "dvr_adaptive", base)
        adaptive.shutdown()

    if "dvr_groups" in parts:
        for b in [int(x) for x in args.groups.split(",")]:
            grouped, _ = engine(args, verify_group=b)
            grouped.generate(prompts(4, 64, 99, vocab), warm, use_tqdm=False)
            shares = [int(x) for x in args.group_shares.split(",")]
            base = dvr_shares(args, res, grouped, vocab, shares, f"dvr_b{b}", base)
            grouped.shutdown()
    res.put("finished", time.strftime("%Y-%m-%d %H:%M:%S"))


if __name__ == "__main__":
    main()
