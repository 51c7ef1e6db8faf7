"""What LoRA adapters cost: offline throughput of the bench model alone, with every request on
one adapter, and with requests spread over four adapters, side by side in one process,
alternating rounds (this machine is noisy; compare ratios within a round).

N random 128-token prompts -> 64 greedy tokens each (``ignore_eos``), after a warm-up; the
adapters are random PEFT directories of rank R on all seven projections of every layer
(written to a temporary directory). Prints tok/s per configuration and round, and each
configuration's ratio to the base model's in the same round.

    python benches/lora_throughput.py 16 64 --rank 16 --rounds 2
    python benches/lora_throughput.py 1 16 64 device=cuda dtype=bfloat16   # engine settings

Extra ``key=value`` arguments go to ``LLM`` (integers and true/false parsed), as in
``offline_throughput.py``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_model import bench_model
from safetensors.numpy import save_file

from detspec import LLM, SamplingParams

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(dir_: Path, cfg: dict, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter on every projection of every layer of ``cfg``'s model."""
    hs, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or hs // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dims = {
        "q_proj": (hs, q),
        "k_proj": (hs, kv),
        "v_proj": (hs, kv),
        "o_proj": (q, hs),
        "gate_proj": (hs, inter),
        "up_proj": (hs, inter),
        "down_proj": (inter, hs),
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in MODULES:
            part = "self_attn" if m in MODULES[:4] else "mlp"
            p = f"base_model.model.model.layers.{layer}.{part}.{m}"
            din, dout = dims[m]
            tensors[f"{p}.lora_A.weight"] = (rng.standard_normal((rank, din)) * 0.02).astype("f4")
            tensors[f"{p}.lora_B.weight"] = (rng.standard_normal((dout, rank)) * 0.02).astype("f4")
    dir_.mkdir(parents=True)
    save_file(tensors, str(dir_ / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    (dir_ / "adapter_config.json").write_text(json.dumps({**config, "target_modules": MODULES}))
    return str(dir_)


def main(argv: list[str]) -> None:
    sizes, rank, rounds = [], 16, 2
    kw: dict[str, int | str | bool] = {}
    args = iter(argv)
    for a in args:
        if a == "--rank":
            rank = int(next(args))
        elif a == "--rounds":
            rounds = int(next(args))
        elif "=" in a:
            k, v = a.split("=", 1)
            kw[k] = int(v) if v.isdigit() else {"true": True, "false": False}.get(v, v)
        else:
            sizes.append(int(a))
    model = str(bench_model(os.environ.get("DETSPEC_BENCH_MODEL", "/tmp/benchmodel"), "bench"))
    cfg = json.loads((Path(model) / "config.json").read_text())
    tmp = Path(tempfile.mkdtemp(prefix="detspec-lora-bench-"))
    llm = LLM(model, enable_lora=True, max_lora_rank=rank, **kw)
    for i in range(4):
        llm.load_lora(f"l{i}", write_adapter(tmp / f"l{i}", cfg, rank, i))
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    rng = np.random.default_rng(0)
    configs = {
        "base": lambda n: None,
        "1 adapter": lambda n: "l0",
        "4 adapters": lambda n: [f"l{i % 4}" for i in range(n)],
    }
    print(f"load average {os.getloadavg()[0]:.2f}; rank {rank}, {cfg['num_hidden_layers']} layers")
    for n in sizes:
        warm = [rng.integers(3, 30000, 128).tolist() for _ in range(n)]
        llm.generate(warm, params, use_tqdm=False, lora_request=configs["4 adapters"](n))
        for r in range(rounds):
            speeds = {}
            for name, lora in configs.items():
                prompts = [rng.integers(3, 30000, 128).tolist() for _ in range(n)]
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora(n))
                dt = time.perf_counter() - t
                speeds[name] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
            line = ", ".join(
                f"{k} {v:,.0f} tok/s ({v / speeds['base']:.2f}x)" for k, v in speeds.items()
            )
            print(f"batch {n} round {r}: {line}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
