"""The Rust–Python boundary: errors carry their parameter, the engine owns request validation
(one rule on every surface), delta streaming, and the engine settings declared once."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import pickle

import pytest

from detspec import LLM, AsyncLLM, SamplingParams, _core
from detspec.engine_args import ENGINE_SETTINGS, add_engine_arguments, engine_settings_from_args
from detspec.errors import EngineStoppedError, InvalidRequestError


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_pages=128)


def test_errors_carry_their_parameter(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(temperature=-1.0)
    assert e.value.param == "temperature" and "temperature" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[1, llm.vocab_size]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "prompt"
    back = pickle.loads(pickle.dumps(e.value))
    assert back.param == "prompt" and str(back) == str(e.value)


def test_validate_request_names_the_prompt(llm: LLM) -> None:
    llm.validate_request([1, 2, 3], SamplingParams(max_tokens=4))
    cases = [
        ([], "prompt[1]", "is empty"),
        ([1, llm.vocab_size], "prompt[1]", "outside the vocabulary"),
        ([1] * llm.max_model_len, "prompt[1]", "max_model_len"),
        ([1, -2], "prompt[1]", "non-negative"),
    ]
    for ids, param, what in cases:
        with pytest.raises(InvalidRequestError, match=what) as e:
            llm.validate_request(ids, prompt_param=param)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError) as e:
        llm.validate_request(None, SamplingParams(stop_token_ids=[llm.vocab_size]))
    assert e.value.param == "stop_token_ids"


@pytest.mark.parametrize("surface", ["LLM", "AsyncLLM", "validate_request"])
def test_deterministic_sampling_needs_a_seed_everywhere(llm: LLM, surface: str) -> None:
    params = SamplingParams(temperature=0.7, max_tokens=4, deterministic=True)
    with pytest.raises(InvalidRequestError) as e:
        if surface == "LLM":
            llm.generate(["Hello"], params, use_tqdm=False)
        elif surface == "validate_request":
            llm.validate_request([1, 2], params)
        else:
            engine = AsyncLLM(num_kv_pages=64)

            async def run() -> None:
                async for _ in engine.generate("Hello", params):
                    pass

            try:
                asyncio.run(run())
            finally:
                engine.shutdown()
    assert e.value.param == "seed"
    # Greedy, or seeded: reproducible, accepted.
    llm.validate_request([1, 2], SamplingParams(temperature=0.0, deterministic=True))
    llm.validate_request([1, 2], SamplingParams(temperature=0.7, seed=3, deterministic=True))


def test_determinism_off_refuses_deterministic_requests() -> None:
    off = LLM(determinism="off", num_kv_pages=64)
    try:
        assert off.determinism == "off"
        with pytest.raises(InvalidRequestError) as e:
            off.validate_request([1], SamplingParams(temperature=0.0, deterministic=True))
        assert e.value.param == "deterministic"
    finally:
        off.shutdown()


def test_gpu_memory_utilization_is_checked_and_changes_nothing_on_the_cpu() -> None:
    """vLLM's ``gpu_memory_utilization`` (every vLLM launch line carries it) is accepted and
    checked; on the CPU the KV pool is the default one, as in vLLM's CPU build (on a GPU it
    sizes the pool: ``src/model/memory.rs``, docs/cuda.md)."""
    for bad in (0.0, 1.5):
        with pytest.raises(InvalidRequestError) as e:
            LLM(gpu_memory_utilization=bad, num_kv_pages=16)
        assert e.value.param == "gpu_memory_utilization"
    sizes = []
    for kw in ({}, {"gpu_memory_utilization": 0.5}):
        engine = LLM(**kw)
        try:
            sizes.append(engine.kv_pages()[1])
        finally:
            engine.shutdown()
    assert sizes[0] == sizes[1] > 0


def test_delta_stream_concatenates_to_the_snapshot() -> None:
    engine = AsyncLLM(num_kv_pages=64)
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=12, logprobs=1)

    async def run(delta: bool) -> list:
        return [o async for o in engine.generate("Once upon", params, delta=delta)]

    try:
        cumulative = asyncio.run(run(False))
        deltas = asyncio.run(run(True))
    finally:
        engine.shutdown()
    last = cumulative[-1]
    assert deltas[-1].finished
    for i, c in enumerate(last.outputs):
        parts = [d.outputs[i] for d in deltas]
        assert "".join(p.text for p in parts) == c.text
        assert [t for p in parts for t in p.token_ids] == list(c.token_ids)
        assert [lp for p in parts for lp in p.logprobs] == c.logprobs
        assert parts[-1].finish_reason == c.finish_reason
    with pytest.raises(EngineStoppedError):
        asyncio.run(run(True))


def test_skip_special_tokens_is_an_engine_parameter(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok is not None
    eos = llm.eos_token_ids[0]
    prompt = tok.encode("Hello", add_special_tokens=False)
    params = dict(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True, stop_token_ids=[])
    kept = llm.generate([prompt + [eos]], SamplingParams(**params), use_tqdm=False)[0]
    raw = llm.generate(
        [prompt + [eos]], SamplingParams(**params, skip_special_tokens=False), use_tqdm=False
    )[0]
    assert kept.outputs[0].token_ids == raw.outputs[0].token_ids
    ids = raw.outputs[0].token_ids
    assert raw.outputs[0].text == tok.decode(ids, skip_special_tokens=False)
    assert kept.outputs[0].text == tok.decode(ids, skip_special_tokens=True)


def _defaults_of_core_engine() -> dict[str, object]:
    sig = inspect.signature(_core.Engine)
    return {n: p.default for n, p in sig.parameters.items() if n != "model_dir"}


def test_settings_are_declared_once() -> None:
    names = [s.name for s in ENGINE_SETTINGS]
    # The Rust binding takes exactly these, with the same defaults.
    assert _defaults_of_core_engine() == {s.name: s.default for s in ENGINE_SETTINGS}
    # LLM / AsyncLLM show them as keyword-only parameters.
    for cls in (LLM, AsyncLLM):
        params = inspect.signature(cls).parameters
        assert [n for n in params if n != "model"] == names
    with pytest.raises(TypeError, match="frobnicate"):
        LLM(frobnicate=1)
    with pytest.raises(InvalidRequestError) as e:
        LLM(max_num_seqs=-1)
    assert e.value.param == "max_num_seqs"


@pytest.mark.parametrize("surface", ["serve", "bench"])
def test_every_setting_reaches_the_command_line(surface: str) -> None:
    p = argparse.ArgumentParser()
    if surface == "serve":
        from detspec.server.serve_flags import add_serve_arguments

        add_serve_arguments(p)
    else:
        from detspec.bench import add_bench_arguments

        add_bench_arguments(p)
    args = p.parse_args(["--kernel-profile", "shape_dependent", "--no-enable-prefix-caching"])
    assert engine_settings_from_args(args) == {
        "kernel_profile": "shape_dependent",
        "enable_prefix_caching": False,
    }
    flags = {a.dest for a in p._actions}
    assert {s.name for s in ENGINE_SETTINGS} <= flags


def test_add_engine_arguments_leaves_defaults_to_the_engine() -> None:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_settings_from_args(p.parse_args([])) == {}


def test_every_setting_reaches_ray() -> None:
    pytest.importorskip("ray.serve")
    from detspec.ray import DetspecServeArgs

    fields = DetspecServeArgs.model_fields
    assert {s.name for s in ENGINE_SETTINGS} <= fields.keys()
    args = DetspecServeArgs.model_validate({"kernel_profile": "shape_dependent"})
    assert args.kernel_profile == "shape_dependent"
