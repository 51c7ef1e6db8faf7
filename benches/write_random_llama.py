"""Writes a randomly initialised Llama-3-shaped checkpoint (no download): the GPU benchmarks'
and parity tests' large models; ``--shape qwen3-30b-a3b`` writes a Qwen3-MoE-shaped mixture of
experts instead (``--num-layers`` cuts any shape's depth). Weights are drawn on the GPU when
there is one.

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

``--fp8`` writes the decoder layers' matrices as an FP8 checkpoint does (transformers' ``fp8``
format, DeepSeek-V3's and Qwen3-FP8's: E4M3 codes, an f32 ``weight_scale_inv`` per 128 × 128
block, a block's scale its largest magnitude over 448); the embedding and LM head stay in
``--dtype``.

    python benches/write_random_llama.py --shape llama3-8b --fp8 --out /tmp/llama3-8b-fp8

``--peaked`` writes a model with a trained model's kind of confidence instead (for DVR, whose
cost depends on how often the fast path and the verifier disagree on a token): every token
``t`` has a planted successor ``perm1[t]`` whose logit is ``--top-logit`` (default 20) while
the others are N(0, (top-logit / sqrt(hidden))^2) (0.3^2 at hidden 4096), so greedy decoding
is sure of nearly every token; a ``--choice-fraction`` of the tokens also have a second
successor ``perm2[t]`` whose logit is below the first by N(0, ``--choice-gap``^2) (default
1.5): the choice points, where a near-tie can be decided differently by two reduction orders.
How: the embedding is N(0, 1), the attention and MLP output projections are scaled by
``--residual-scale`` (default 0.02) so the last hidden state is mostly the current token's
embedding plus a context-dependent remainder, and ``lm_head`` row ``perm1[t]`` is ``E[t]``
scaled to the top logit. ``planted.npz`` beside the weights holds ``perm1`` and ``perm2``
(-1 where none). On ``llama3-tiny`` in float32 with ``--choice-fraction 0.1`` (16 prompts, 64
greedy tokens each, detspec on the CPU): 95.0 % of tokens follow ``perm1``, 5.0 % ``perm2``,
the chosen token's median logprob is -7e-4 and 6.7 % of tokens have one below -0.1.

    python benches/write_random_llama.py --shape llama3-8b --peaked --choice-fraction 0.1 \\
        --out /tmp/llama3-8b-peaked
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
    # A small model of the same kind (full vocabulary) for dry runs on a CPU.
    "llama3-tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
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
    # Qwen3-30B-A3B geometry: a mixture of experts (128 experts of width 768, 8 per token) with
    # Qwen3's attention (head_dim 128, q/k norms) and vocabulary. 61 GB in bf16: take fewer
    # layers (--num-layers 12: 16 GB) on a 24 GB machine.
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    ),
}


VOCAB = 128256
QWEN_VOCAB = 151936


def config_dict(shape: str, dtype: str, max_pos: int, num_layers: int | None = None) -> dict:
    """config.json of the shape (what transformers' LlamaConfig, or Qwen3MoeConfig, writes, as
    plain JSON); ``num_layers`` overrides its depth."""
    s = dict(SHAPES[shape])
    if num_layers is not None:
        s["num_hidden_layers"] = num_layers
    moe = s.pop("moe", None)
    if moe is not None:
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": QWEN_VOCAB,
            "max_position_embeddings": max_pos,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "hidden_act": "silu",
            "attention_bias": False,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "torch_dtype": dtype,
            **moe,
            **s,
        }
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
        "head_dim": s.get("head_dim", s["hidden_size"] // s["num_attention_heads"]),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        **s,
    }


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of a Llama (or Qwen3-MoE) checkpoint of ``cfg``, in file order."""
    hs, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts = cfg.get("num_experts", 0)
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hs))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (hs,)),
            (f"{p}.self_attn.q_proj.weight", (h * d, hs)),
            (f"{p}.self_attn.k_proj.weight", (kvh * d, hs)),
            (f"{p}.self_attn.v_proj.weight", (kvh * d, hs)),
            (f"{p}.self_attn.o_proj.weight", (hs, h * d)),
            (f"{p}.post_attention_layernorm.weight", (hs,)),
        ]
        if experts:
            width = cfg["moe_intermediate_size"]
            out += [
                (f"{p}.self_attn.q_norm.weight", (d,)),
                (f"{p}.self_attn.k_norm.weight", (d,)),
                (f"{p}.mlp.gate.weight", (experts, hs)),
            ]
            for e in range(experts):
                q = f"{p}.mlp.experts.{e}"
                out += [
                    (f"{q}.gate_proj.weight", (width, hs)),
                    (f"{q}.up_proj.weight", (width, hs)),
                    (f"{q}.down_proj.weight", (hs, width)),
                ]
        else:
            out += [
                (f"{p}.mlp.gate_proj.weight", (inter, hs)),
                (f"{p}.mlp.up_proj.weight", (inter, hs)),
                (f"{p}.mlp.down_proj.weight", (hs, inter)),
            ]
    out.append(("model.norm.weight", (hs,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (vocab, hs)))
    return out


def write_streaming(args: argparse.Namespace) -> None:
    """Sharded safetensors written tensor by tensor: peak memory ~ one tensor."""
    import json
    import struct

    import numpy as np

    if args.dtype == "float16":
        raise SystemExit("--streaming writes bfloat16 or float32")
    cfg = config_dict(args.shape, args.dtype, args.max_position_embeddings, args.num_layers)
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
    cfg = config_dict(args.shape, args.dtype, args.max_position_embeddings, args.num_layers)
    if args.fp8:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shards = shard_plan(cfg, dtype.itemsize)
    planted = Planted(args, cfg, gen, device) if args.peaked else None
    weight_map: dict[str, str] = {}
    total = 0
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=dtype)
            elif planted is not None:
                t = planted.tensor(name, shape).to(dtype)
            else:
                t = torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.02
            if args.fp8 and len(shape) == 2 and name.startswith("model.layers."):
                t, tensors[f"{name}_scale_inv"] = fp8_blocks(t.float())
            tensors[name] = t.cpu()
            weight_map[name] = fname
            total += t.numel()
        save_file(tensors, str(args.out / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total * dtype.itemsize}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {args.out}: {total / 1e9:.2f}B parameters, {args.dtype} ({device})")


FP8_BLOCK = (128, 128)


def fp8_blocks(w):
    """E4M3 codes of ``w`` (f32 ``[rows, cols]``, both multiples of 128) and its scales, one a
    128 × 128 block (the block's largest magnitude over 448)."""
    import torch

    rows, cols = w.shape
    br, bc = FP8_BLOCK
    blocks = w.view(rows // br, br, cols // bc, bc)
    scales = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    codes = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn).view(rows, cols)
    return codes, scales.contiguous()


class Planted:
    """The ``--peaked`` model's tensors (see the module's doc): drawn in float32 on ``device``,
    the embedding kept until ``lm_head`` is built from it."""

    def __init__(self, args: argparse.Namespace, cfg: dict, gen, device: str) -> None:
        import numpy as np
        import torch

        self.torch, self.gen, self.device = torch, gen, device
        self.hs = cfg["hidden_size"]
        self.residual_scale = args.residual_scale
        # <E[t], E[t]> ~ hs, so the planted logit is beta * hs and an unrelated row's
        # beta * sqrt(hs) * N(0, 1).
        self.beta = args.top_logit / self.hs
        rng = np.random.default_rng(args.seed)
        self.perm1 = rng.permutation(VOCAB)
        self.perm2 = np.full(VOCAB, -1)
        choice = rng.choice(VOCAB, size=round(args.choice_fraction * VOCAB), replace=False)
        # A second successor other than the first.
        second = (self.perm1[choice] + rng.integers(1, VOCAB, len(choice))) % VOCAB
        self.perm2[choice] = second
        # The second successor's logit sits below the first's by N(0, gap^2) (its share of the
        # row: 1 - gap / top_logit).
        self.second_weight = 1.0 - rng.standard_normal(len(choice)) * (
            args.choice_gap / args.top_logit
        )
        self.choice = choice
        self.embedding = None
        np.savez(args.out / "planted.npz", perm1=self.perm1, perm2=self.perm2)

    def on_device(self, a):
        return self.torch.as_tensor(a, device=self.device)

    def randn(self, shape: tuple[int, ...]):
        return self.torch.randn(shape, generator=self.gen, device=self.device)

    def tensor(self, name: str, shape: tuple[int, ...]):
        torch = self.torch
        if name == "model.embed_tokens.weight":
            self.embedding = self.randn(shape)
            return self.embedding
        if name == "lm_head.weight":
            if self.embedding is None:
                raise SystemExit("--peaked: lm_head before the embedding")
            e = self.embedding
            head = torch.zeros(shape, device=self.device)
            head[self.on_device(self.perm1)] = e
            w = torch.as_tensor(self.second_weight, device=self.device, dtype=e.dtype)
            second, choice = self.on_device(self.perm2[self.choice]), self.on_device(self.choice)
            head.index_add_(0, second, e[choice] * w[:, None])
            return head * self.beta
        w = self.randn(shape) * 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w *= self.residual_scale
        return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--max-position-embeddings", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=None, help="override the shape's depth")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--streaming",
        action="store_true",
        help="numpy only, one tensor at a time (for checkpoints larger than memory in float32)",
    )
    p.add_argument("--fp8", action="store_true", help="FP8 layer matrices (module doc)")
    p.add_argument("--peaked", action="store_true", help="planted successors (module doc)")
    p.add_argument("--top-logit", type=float, default=20.0)
    p.add_argument("--choice-fraction", type=float, default=0.0)
    p.add_argument("--choice-gap", type=float, default=1.5)
    p.add_argument("--residual-scale", type=float, default=0.02)
    args = p.parse_args()
    if args.fp8 and (args.streaming or args.peaked):
        raise SystemExit("--fp8 needs the torch writer, without --peaked")
    if args.peaked and (args.streaming or SHAPES[args.shape]["tie_word_embeddings"]):
        raise SystemExit("--peaked needs the torch writer and an untied lm_head")
    if args.peaked and "moe" in SHAPES[args.shape]:
        raise SystemExit("--peaked writes Llama shapes only")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.streaming:
        write_streaming(args)
        return

    write_torch(args)


if __name__ == "__main__":
    main()
