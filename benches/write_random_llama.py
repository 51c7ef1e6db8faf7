"""Writes a randomly initialised Llama-3-shaped checkpoint (no download): the GPU benchmarks'
and parity tests' large models. Weights are drawn on the GPU when there is one.

    python benches/write_random_llama.py --shape llama3-8b --out /tmp/llama3-8b-random
    python benches/write_random_llama.py --shape llama3-1b --dtype float32 --out /tmp/llama3-1b

Then e.g. ``DETSPEC_BENCH_MODEL=/tmp/llama3-8b-random python benches/offline_throughput.py 64
device=cuda`` or ``python benches/dvr_throughput.py --model-dir /tmp/llama3-8b-random --device
cuda``.

By default torch draws each tensor in the target dtype (on the GPU when there is one) and the
shards are written one at a time. ``--streaming`` writes the same shapes with numpy only, one
tensor at a time (no torch needed). Either way: sharded safetensors with an index, linear and
embedding weights N(0, 0.02), norms 1, ``--seed`` makes it reproducible.

    python benches/write_random_llama.py --shape llama3-8b --streaming --out /tmp/llama3-8b-bf16
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

SHAPES = {
    # Llama-3.1-8B / Llama-3.2-1B geometry (rope_scaling "llama3" as in their configs).
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "llama3-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
}


VOCAB = 128256


def config_dict(shape: str, dtype: str, max_pos: int) -> dict:
    """config.json of the shape (what transformers' LlamaConfig writes, as plain JSON)."""
    s = SHAPES[shape]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "head_dim": s["hidden_size"] // s["num_attention_heads"],
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        **s,
    }


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of a Llama checkpoint of ``cfg``, in file order."""
    hs, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg["head_dim"]
    h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, hs))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (hs,)),
            (f"{p}.self_attn.q_proj.weight", (h * d, hs)),
            (f"{p}.self_attn.k_proj.weight", (kvh * d, hs)),
            (f"{p}.self_attn.v_proj.weight", (kvh * d, hs)),
            (f"{p}.self_attn.o_proj.weight", (hs, h * d)),
            (f"{p}.post_attention_layernorm.weight", (hs,)),
            (f"{p}.mlp.gate_proj.weight", (inter, hs)),
            (f"{p}.mlp.up_proj.weight", (inter, hs)),
            (f"{p}.mlp.down_proj.weight", (hs, inter)),
        ]
    out.append(("model.norm.weight", (hs,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (VOCAB, hs)))
    return out


def write_streaming(args: argparse.Namespace) -> None:
    """Sharded safetensors written tensor by tensor: peak memory ~ one tensor."""
    import json
    import struct

    import numpy as np

    if args.dtype == "float16":
        raise SystemExit("--streaming writes bfloat16 or float32")
    cfg = config_dict(args.shape, args.dtype, args.max_position_embeddings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2))
    itemsize = 2 if args.dtype == "bfloat16" else 4
    st_dtype = "BF16" if args.dtype == "bfloat16" else "F32"
    shards = shard_plan(cfg, itemsize)
    rng = np.random.default_rng(args.seed)
    weight_map: dict[str, str] = {}
    total = 0
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in shard:
            nbytes = int(np.prod(shape)) * itemsize
            header[name] = {
                "dtype": st_dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = fname
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(args.out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for _name, shape in shard:
                n = int(np.prod(shape))
                chunk = 1 << 24
                for start in range(0, n, chunk):
                    m = min(chunk, n - start)
                    if len(shape) == 1:
                        x = np.ones(m, dtype=np.float32)
                    else:
                        x = rng.standard_normal(m, dtype=np.float32) * np.float32(0.02)
                    if itemsize == 2:
                        b = x.view(np.uint32)
                        # round to nearest even (finite values only here)
                        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
                        f.write(b.astype(np.uint16).tobytes())
                    else:
                        f.write(x.tobytes())
                total += n
        print(f"wrote {fname}", flush=True)
    index = {"metadata": {"total_size": total * itemsize}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {args.out}: {total / 1e9:.2f}B parameters, {args.dtype} (streaming)")


def shard_plan(cfg: dict, itemsize: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors grouped into shards of at most 4 GiB, in file order."""
    shard_limit = 4 << 30
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(cfg):
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > shard_limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_torch(args: argparse.Namespace) -> None:
    """Each tensor drawn by torch (on the GPU when there is one) directly in the target dtype,
    one shard at a time: an 8B bf16 checkpoint in seconds on a GPU machine, peak host memory
    one shard."""
    import json

    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, args.dtype)
    cfg = config_dict(args.shape, args.dtype, args.max_position_embeddings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shards = shard_plan(cfg, dtype.itemsize)
    weight_map: dict[str, str] = {}
    total = 0
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=dtype)
            else:
                t = torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.02
            tensors[name] = t.cpu()
            weight_map[name] = fname
            total += t.numel()
        save_file(tensors, str(args.out / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total * dtype.itemsize}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {args.out}: {total / 1e9:.2f}B parameters, {args.dtype} ({device})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--max-position-embeddings", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--streaming",
        action="store_true",
        help="numpy only, one tensor at a time (for checkpoints larger than memory in float32)",
    )
    args = p.parse_args()
    if args.streaming:
        write_streaming(args)
        return

    write_torch(args)


if __name__ == "__main__":
    main()
