"""Writes a randomly initialised Llama-3-shaped checkpoint (no download): the GPU benchmarks'
and parity tests' large models. Weights are drawn on the GPU when there is one.

    python benches/write_random_llama.py --shape llama3-8b --out /tmp/llama3-8b-random
    python benches/write_random_llama.py --shape llama3-1b --dtype float32 --out /tmp/llama3-1b

Then e.g. ``DETSPEC_BENCH_MODEL=/tmp/llama3-8b-random python benches/offline_throughput.py 64
device=cuda`` or ``python benches/dvr_throughput.py --model-dir /tmp/llama3-8b-random --device
cuda``.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--max-position-embeddings", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, args.dtype)
    cfg = LlamaConfig(
        vocab_size=128256,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
        torch_dtype=args.dtype,
        **SHAPES[args.shape],
    )
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(args.out, safe_serialization=True)
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote {args.out}: {n / 1e9:.2f}B parameters, {args.dtype}")


if __name__ == "__main__":
    main()
