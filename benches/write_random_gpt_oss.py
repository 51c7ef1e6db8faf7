"""Writes a randomly initialised gpt-oss-20b-shaped checkpoint with its experts in MXFP4, as
the released checkpoints store them (no download, numpy only, one tensor at a time): 13.8 GB
for the 20b shape. For ``benches/big_model.py``: the engine keeps the experts in MXFP4 on the
CPU, so the model runs in about 14 GB where its bf16 form takes 42.

    python benches/write_random_gpt_oss.py --out /tmp/gpt-oss-20b-mxfp4
    python benches/big_model.py /tmp/gpt-oss-20b-mxfp4 --out /tmp/gpt-oss.json

``--num-layers`` cuts the depth. Weights: bf16 matrices N(0, 0.02), biases and sinks 0, norms
1; the experts' codes uniform bytes and their scales 2^-8 .. 2^-6 (weights up to 0.09).
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np

GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    attention_bias=True,
    eos_token_id=200002,
    head_dim=64,
    hidden_act="silu",
    hidden_size=2880,
    intermediate_size=2880,
    max_position_embeddings=131072,
    num_attention_heads=64,
    num_experts_per_tok=4,
    num_hidden_layers=24,
    num_key_value_heads=8,
    num_local_experts=32,
    rms_norm_eps=1e-05,
    rope_scaling=dict(
        beta_fast=32.0,
        beta_slow=1.0,
        factor=32.0,
        original_max_position_embeddings=4096,
        rope_type="yarn",
        truncate=False,
    ),
    rope_theta=150000,
    sliding_window=128,
    swiglu_limit=7.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    vocab_size=201088,
    quantization_config=dict(
        quant_method="mxfp4",
        modules_to_not_convert=[
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    ),
)


def tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in checkpoint order; kind: matrix, ones, zeros, codes, scales."""
    hs, inter, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    h, kvh, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    vocab = cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (vocab, hs), "matrix")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (hs,), "ones"),
            (f"{p}.post_attention_layernorm.weight", (hs,), "ones"),
            (f"{p}.self_attn.sinks", (h,), "zeros"),
        ]
        for name, rows, cols in (("q", h * d, hs), ("k", kvh * d, hs), ("v", kvh * d, hs)):
            out += [
                (f"{p}.self_attn.{name}_proj.weight", (rows, cols), "matrix"),
                (f"{p}.self_attn.{name}_proj.bias", (rows,), "zeros"),
            ]
        out += [
            (f"{p}.self_attn.o_proj.weight", (hs, h * d), "matrix"),
            (f"{p}.self_attn.o_proj.bias", (hs,), "zeros"),
            (f"{p}.mlp.router.weight", (e, hs), "matrix"),
            (f"{p}.mlp.router.bias", (e,), "zeros"),
        ]
        for part, rows, cols in (("gate_up_proj", 2 * inter, hs), ("down_proj", hs, inter)):
            x = f"{p}.mlp.experts.{part}"
            out += [
                (f"{x}_blocks", (e, rows, cols // 32, 16), "codes"),
                (f"{x}_scales", (e, rows, cols // 32), "scales"),
                (f"{x}_bias", (e, rows), "zeros"),
            ]
    out += [("model.norm.weight", (hs,), "ones"), ("lm_head.weight", (vocab, hs), "matrix")]
    return out


def to_bf16(x: np.ndarray) -> bytes:
    b = x.view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def write(out: Path, cfg: dict, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    rng = np.random.default_rng(seed)
    plan = tensors(cfg)
    # Shards of about 4 GB, written tensor by tensor (peak memory ~ one chunk).
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    itemsize = {"codes": 1, "scales": 1}
    for t in plan:
        nbytes = int(np.prod(t[1])) * itemsize.get(t[2], 2)
        if size + nbytes > 4 << 30 and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    weight_map, total = {}, 0
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, kind in shard:
            dtype = "U8" if kind in itemsize else "BF16"
            nbytes = int(np.prod(shape)) * itemsize.get(kind, 2)
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            total += nbytes
            weight_map[name] = fname
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for _name, shape, kind in shard:
                n = int(np.prod(shape))
                for start in range(0, n, 1 << 26):
                    m = min(1 << 26, n - start)
                    if kind == "codes":
                        f.write(rng.integers(0, 256, m, dtype=np.uint8).tobytes())
                    elif kind == "scales":
                        f.write(rng.integers(127 - 8, 127 - 5, m, dtype=np.uint8).tobytes())
                    elif kind == "matrix":
                        f.write(
                            to_bf16(rng.standard_normal(m, dtype=np.float32) * np.float32(0.02))
                        )
                    else:
                        f.write(to_bf16(np.full(m, 1.0 if kind == "ones" else 0.0, np.float32)))
        print(f"wrote {fname}", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {out}: {total / 1e9:.1f} GB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = dict(GPT_OSS_20B)
    if args.num_layers:
        cfg["num_hidden_layers"] = args.num_layers
    cfg["layer_types"] = [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    write(args.out, cfg, args.seed)


if __name__ == "__main__":
    main()
