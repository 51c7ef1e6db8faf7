"""Decode speed of a hybrid model on the CPU (LFM2-1.2B-shaped, Qwen3.5-2B-shaped, or a
Granite-4.0-H or Nemotron-H of 1.5 B parameters), against the memory-bandwidth bound.

Writes the model on first use (transformers' class at the geometry below, random N(0, 0.02)
bf16 weights; no download), loads it with ``auto`` (bf16 weights and cache), and times greedy
decoding of 32-token prompts at batch 1 and 16 (fast path, and every request deterministic).
Each decode rate is the difference of a 2-token run and a longer one on fresh prompts, so
prefill cancels and neither run reads the other's prefix from the cache.

    python benches/hybrid_decode.py /tmp/lfm2-1.2b
    python benches/hybrid_decode.py --arch qwen3_5 /tmp/qwen3.5-2b
    python benches/hybrid_decode.py --arch granite4_h /tmp/granite-4.0-h-1.5b
    python benches/hybrid_decode.py --arch nemotron_h /tmp/nemotron-h-1.5b

``--group`` times a GRPO group instead: ``n`` = 8 samples (T = 1, seeded) of one 512-token
prompt, 16 tokens each, on an engine with the prefix cache and on one without, alternating,
two rounds: with it the first sample's prefill keeps its state after the prompt's last full
page and the other seven start from there. ``--few-shot`` times 16 prompts sent together that
share 448 tokens (an eval's few-shot examples), the same way.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import time
from pathlib import Path

import numpy as np
from bench_model import bench_model
from big_model import bandwidth_two_processes

from detspec import LLM, SamplingParams


def config(arch: str):
    """The transformers class and config of `arch`'s bench model: LFM2-1.2B's hub geometry
    (1.17 B parameters), a Qwen3.5 of 2 B parameters (Qwen3.5's layer pattern and DeltaNet
    widths at half the default model's hidden size: 18 DeltaNet layers, 6 attending), or a
    dense Granite 4.0-H of 1.5 B parameters (hidden 1536, 40 layers, 4 of them attending without
    rope; Mamba2 mixers of 48 heads of 64 with a state of 128, one group), or a Nemotron-H of
    1.5 B parameters (laid out as Nemotron-H-8B, with its Mamba2 widths, at hidden 2048: 31 layers
    of one sublayer each, 14 Mamba2 mixers of 64 heads of 64 with a state of 128 in 8 groups,
    14 squared-ReLU MLPs 8192 wide, 3 attending without positions)."""
    import transformers

    if arch == "nemotron_h":
        pattern = "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-"
        kinds = {"M": "linear_attention", "-": "mlp", "*": "full_attention"}
        return transformers.NemotronHForCausalLM, transformers.NemotronHConfig(
            vocab_size=131072,
            hidden_size=2048,
            intermediate_size=8192,
            layers_block_type=[kinds[c] for c in pattern],
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            mamba_num_heads=64,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            initializer_range=0.02,
        )

    if arch == "lfm2":
        return transformers.Lfm2ForCausalLM, transformers.Lfm2Config(
            vocab_size=65536,
            hidden_size=2048,
            intermediate_size=12288,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            full_attn_idxs=[2, 5, 8, 10, 12, 14],
            norm_eps=1e-5,
            tie_word_embeddings=True,
            initializer_range=0.02,
        )
    if arch == "granite4_h":
        return transformers.GraniteMoeHybridForCausalLM, transformers.GraniteMoeHybridConfig(
            vocab_size=100352,
            hidden_size=1536,
            num_hidden_layers=40,
            num_attention_heads=12,
            num_key_value_heads=4,
            layer_types=["attention" if i % 10 == 9 else "mamba" for i in range(40)],
            mamba_n_heads=48,
            mamba_d_head=64,
            mamba_d_state=128,
            mamba_n_groups=1,
            num_local_experts=0,
            shared_intermediate_size=4096,
            position_embedding_type=None,
            tie_word_embeddings=True,
            initializer_range=0.02,
        )
    return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )


def write_model(out: Path, arch: str) -> int:
    """The random `arch` checkpoint at ``out``; returns its parameter count."""
    import torch

    torch.manual_seed(0)
    cls, cfg = config(arch)
    model = cls._from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer_dir = bench_model(Path("/tmp/benchmodel"), "bench")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    return sum(p.numel() for p in model.parameters())


def with_and_without_cache(model: Path, what: str, work, rounds: int = 2) -> None:
    """Times `work(llm, rng)` on an engine with the prefix cache and on one without,
    alternating, on fresh prompts; prints each run and the best of each."""
    rng = np.random.default_rng(1)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for caching in (True, False):
            llm = LLM(str(model), num_kv_pages=512, enable_prefix_caching=caching)
            llm.generate([[5] * 40], SamplingParams(max_tokens=2), use_tqdm=False)
            t = time.time()
            work(llm, rng)
            times[caching].append(time.time() - t)
            hits = llm.kv_stats()["prefix_hits"]
            llm.shutdown()
            print(
                f"prefix cache {'on ' if caching else 'off'}: {times[caching][-1]:.2f} s, "
                f"{hits} prompt tokens read from it"
            )
    on, off = min(times[True]), min(times[False])
    print(f"{what}: {on:.2f} s with the cache, {off:.2f} s without ({off / on:.2f}x)")
    print("load average", " ".join(open("/proc/loadavg").read().split()[:3]))


def group_sampling(llm: LLM, rng: np.random.Generator) -> None:
    """A group of 8 samples of one 512-token prompt, 16 tokens each."""
    sp = SamplingParams(temperature=1.0, seed=5, n=8, max_tokens=16, ignore_eos=True)
    llm.generate([[int(x) for x in rng.integers(3, 60000, size=512)]], sp, use_tqdm=False)


def few_shot(llm: LLM, rng: np.random.Generator) -> None:
    """16 prompts of 448 shared tokens (an eval's few-shot examples) and 64 of their own,
    sent together, 4 greedy tokens each."""
    shared = [int(x) for x in rng.integers(3, 60000, size=448)]
    prompts = [shared + [int(x) for x in rng.integers(3, 60000, size=64)] for _ in range(16)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument(
        "--arch", choices=["lfm2", "qwen3_5", "granite4_h", "nemotron_h"], default="lfm2"
    )
    p.add_argument("--group", action="store_true", help="time a GRPO group (see above)")
    p.add_argument("--few-shot", action="store_true", help="time shared few-shot prompts")
    args = p.parse_args()
    if not (args.model / "config.json").exists():
        write_model(args.model, args.arch)
    if args.group:
        with_and_without_cache(args.model, "group of 8 x 512 prompt tokens + 16", group_sampling)
        return
    if args.few_shot:
        with_and_without_cache(args.model, "16 x (448 shared + 64) prompt tokens + 4", few_shot)
        return
    weight_bytes = sum(f.stat().st_size for f in args.model.glob("*.safetensors"))
    bandwidth = bandwidth_two_processes()
    t0 = time.time()
    llm = LLM(str(args.model), num_kv_pages=512)
    load = time.time() - t0
    rng = np.random.default_rng(0)

    def prompts(n: int) -> list[list[int]]:
        return [[int(x) for x in rng.integers(3, 60000, size=32)] for _ in range(n)]

    def decode_rate(batch: int, tokens: int, deterministic: bool = False) -> float:
        def run(n: int) -> float:
            sp = SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=True, deterministic=deterministic
            )
            t = time.time()
            llm.generate(prompts(batch), sp, use_tqdm=False)
            return time.time() - t

        short = run(2)
        return batch * tokens / (run(2 + tokens) - short)

    decode_rate(1, 2)  # warm-up
    b1, b16 = decode_rate(1, 32), decode_rate(16, 16)
    b16_det = decode_rate(16, 16, deterministic=True)
    bound = bandwidth / weight_bytes
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"load {load:.1f} s, peak RSS {peak:.2f} GiB, bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"batch 1: {b1:.2f} tok/s, bound {bound:.2f} ({100 * b1 / bound:.0f} %)")
    print(f"batch 16: {b16:.1f} tok/s; every request deterministic: {b16_det:.1f} tok/s")
    print("load average", " ".join(open("/proc/loadavg").read().split()[:3]))


if __name__ == "__main__":
    main()
