"""The engine settings, declared once.

``ENGINE_SETTINGS`` is the one list of what an engine can be built with: name, type,
default and one line of documentation. ``LLM`` and ``AsyncLLM`` take exactly these keyword
arguments; ``detspec serve``'s and ``detspec bench serve --backend inprocess``'s flags
(:func:`add_engine_arguments`), Ray Serve's :class:`detspec.ray.DetspecServeArgs` and the
bench scripts derive from it, so a setting added here reaches every surface. The Rust
binding (``_core.Engine``) declares the same defaults; a test checks that they agree.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from detspec.errors import InvalidRequestError


@dataclass(frozen=True)
class EngineSetting:
    """One engine setting. ``type`` is the value's type; ``optional`` settings also take
    None (the engine then picks: the model's context, the memory budget, ...)."""

    name: str
    type: type
    default: Any
    doc: str
    choices: tuple[str, ...] | None = None
    optional: bool = False
    # smallest value of an int setting (-1 where that means "no bound", as vLLM's)
    minimum: int = 0

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


ENGINE_SETTINGS: tuple[EngineSetting, ...] = (
    EngineSetting("device", str, "cpu", "cpu, cuda or cuda:N (cuda needs the CUDA wheel)"),
    EngineSetting(
        "dtype",
        str,
        "auto",
        "weights (auto: the checkpoint's dtype where the device runs it: bfloat16 on cpu and "
        "cuda, float16 on cuda; else float32)",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    EngineSetting(
        "kv_cache_dtype",
        str,
        "auto",
        "KV cache (auto: the model's dtype; cpu: float32 or bfloat16)",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    EngineSetting("max_num_seqs", int, 256, "most sequences decoded together in one step"),
    EngineSetting(
        "max_num_batched_tokens", int, 512, "most tokens (prefill + decode) in one forward pass"
    ),
    EngineSetting(
        "num_kv_pages",
        int,
        None,
        "KV pages in the pool (default: sized from kv_cache_bytes)",
        optional=True,
    ),
    EngineSetting(
        "kv_cache_bytes",
        int,
        None,
        "memory budget of the KV pool when num_kv_pages is not given (default 1 GiB, or on "
        "cuda with gpu_memory_utilization what that leaves)",
        optional=True,
    ),
    EngineSetting(
        "gpu_memory_utilization",
        float,
        None,
        "share of the GPU's memory the engine may hold (vLLM's; 0 to 1): on cuda, without "
        "num_kv_pages or kv_cache_bytes, the KV pool takes what the weights and a forward's "
        "headroom leave of it (default: a 1 GiB pool); no effect on cpu",
        optional=True,
    ),
    EngineSetting("page_size", int, 16, "tokens per KV page"),
    EngineSetting(
        "max_model_len",
        int,
        None,
        "longest prompt + output (default: the model's context, its max_position_embeddings "
        "or, under YaRN, the original context times the factor)",
        optional=True,
    ),
    EngineSetting(
        "max_prefill_chunk",
        int,
        None,
        "largest prefill chunk of one sequence per step (default: the whole token budget)",
        optional=True,
    ),
    EngineSetting(
        "determinism",
        str,
        "dvr",
        "dvr: deterministic requests verified beside the fast path; batch_invariant: every "
        "request on invariant kernels; off: deterministic requests refused",
        choices=("dvr", "batch_invariant", "off"),
    ),
    EngineSetting("verify_window", int, 64, "W: rows per request in a verify pass"),
    EngineSetting("verify_group", int, 8, "B: requests per verify pass"),
    EngineSetting(
        "verify_strategy",
        str,
        "auto",
        "how DVR makes deterministic rows reproducible (auto: inline on CPU)",
        choices=("auto", "replay", "inline"),
    ),
    EngineSetting(
        "kernel_profile",
        str,
        "invariant",
        "the CPU GEMMs' reduction-order promise (shape_dependent: the replay test profile)",
        choices=("invariant", "shape_dependent"),
    ),
    EngineSetting(
        "activation_dtype",
        str,
        "auto",
        "what the CPU linear layers multiply bf16 weights by (auto: float32 on cpu, dtype on "
        "cuda; bfloat16: inputs rounded to bf16, bf16 x bf16 products in VDPBF16PS order, "
        "emulated bit for bit where the CPU lacks it: another numeric contract, fingerprint "
        "-abf16; bfloat16_amx: the same on AMX tiles, faster from batch 16 but bits of its "
        "own, AMX CPUs only, fingerprint -abf16amx; needs dtype bfloat16)",
        choices=("auto", "float32", "bfloat16", "bfloat16_amx"),
    ),
    EngineSetting(
        "verify_finish_wait",
        int,
        0,
        "steps a finished deterministic request may wait to fill its verify pass",
    ),
    EngineSetting(
        "verify_window_adaptive",
        bool,
        True,
        "after a rollback, verify that request after fewer speculative tokens (at least W/8), "
        "doubling back to W after clean windows; never changes output",
    ),
    EngineSetting(
        "fault_injection",
        float,
        0.0,
        "share of verify windows forced to mismatch (tests of the rollback path)",
    ),
    EngineSetting(
        "enable_prefix_caching",
        bool,
        True,
        "reuse KV pages of shared prefixes, earlier prompts and answers (deterministic requests "
        "read only pages computed as a deterministic prefill computes them)",
    ),
    EngineSetting(
        "num_threads",
        int,
        None,
        "engine CPU threads (default: one per core)",
        optional=True,
    ),
    EngineSetting(
        "enable_lora",
        bool,
        False,
        "serve LoRA adapters (PEFT directories) on top of the base model, per request",
    ),
    EngineSetting("max_loras", int, 8, "most LoRA adapters loaded at once (with enable_lora)"),
    EngineSetting("max_lora_rank", int, 64, "largest LoRA rank an adapter may have"),
    EngineSetting(
        "max_logprobs",
        int,
        20,
        "most top logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs; "
        "-1: the vocabulary)",
        minimum=-1,
    ),
)

SETTINGS_BY_NAME: dict[str, EngineSetting] = {s.name: s for s in ENGINE_SETTINGS}


def engine_defaults() -> dict[str, Any]:
    """Every setting at its default."""
    return {s.name: s.default for s in ENGINE_SETTINGS}


def resolve_engine_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting, ``settings`` over the defaults. An unknown name is a ``TypeError`` (as
    for any keyword argument); a count that is not an integer of at least its minimum (0,
    or -1 where that means "no bound") is an ``InvalidRequestError`` naming it (instead of a
    bare OverflowError from the conversion to an unsigned integer)."""
    unknown = sorted(set(settings) - SETTINGS_BY_NAME.keys())
    if unknown:
        raise TypeError(
            f"unknown engine setting(s) {', '.join(unknown)} (known: {', '.join(SETTINGS_BY_NAME)})"
        )
    out = engine_defaults()
    out.update(settings)
    for s in ENGINE_SETTINGS:
        value = out[s.name]
        if s.type is int and value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < s.minimum:
                need = "a non-negative integer" if s.minimum == 0 else f"an integer >= {s.minimum}"
                raise InvalidRequestError(
                    f"invalid parameter `{s.name}`: must be {need}, got {value!r}",
                    param=s.name,
                )
    return out


def add_engine_arguments(p: argparse.ArgumentParser, *, prefix: str = "") -> None:
    """One flag per setting (``--max-num-seqs``, ``--enable-prefix-caching/--no-...``),
    defaulting to None so that :func:`engine_settings_from_args` passes on only what was
    given. ``prefix`` names the flags' group in ``--help``."""
    group = p.add_argument_group(f"{prefix}engine settings".strip())
    for s in ENGINE_SETTINGS:
        help_ = f"{s.doc} (default {s.default})"
        if s.type is bool:
            group.add_argument(
                s.flag, dest=s.name, action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            group.add_argument(
                s.flag, dest=s.name, type=s.type, choices=s.choices, default=None, help=help_
            )


def engine_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line (those left out keep their defaults)."""
    return {
        s.name: getattr(args, s.name)
        for s in ENGINE_SETTINGS
        if getattr(args, s.name, None) is not None
    }


def engine_settings_doc() -> str:
    """The settings as a docstring paragraph (for ``LLM``/``AsyncLLM``)."""
    return "\n".join(
        f"    ``{s.name}`` (default ``{s.default!r}``): {s.doc}." for s in ENGINE_SETTINGS
    )


__all__ = [
    "ENGINE_SETTINGS",
    "EngineSetting",
    "add_engine_arguments",
    "engine_defaults",
    "engine_settings_from_args",
    "resolve_engine_settings",
]
