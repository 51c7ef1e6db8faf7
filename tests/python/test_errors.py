"""Errors: the right exception class, a message that names the culprit, and an engine
that keeps serving after a rejected request. Model dirs are copied before corruption."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

# isort: split
import detspec
from detspec import DetspecError, InvalidRequestError, ModelLoadError, SamplingParams

UP_PROJ = "model.layers.0.mlp.up_proj.weight"


def load_llm(path) -> detspec.LLM:
    return detspec.LLM(str(path), device="cpu")


def resave(path, edit) -> None:
    """Rewrite a safetensors file after `edit(tensors_dict)`."""
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def assert_load_error(path, *culprits: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as excinfo:
        load_llm(path)
    err = excinfo.value
    assert isinstance(err, DetspecError)
    for culprit in culprits:
        assert culprit in str(err), f"{culprit!r} not named in: {err}"
    return err


def greedy(max_tokens=8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# --------------------------------------------------------------------------- loading


def test_exception_hierarchy():
    assert issubclass(DetspecError, Exception)
    assert issubclass(ModelLoadError, DetspecError)
    assert issubclass(InvalidRequestError, DetspecError)
    assert issubclass(InvalidRequestError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "culprits"),
    [
        ({"device": "tpu"}, ("device", "tpu")),
        ({"device": "cuda:x"}, ("device", "cuda:x")),
        ({"dtype": "int8"}, ("dtype", "int8")),
        # The CPU runs float32 and bfloat16 (weights; activations are float32).
        ({"dtype": "float16"}, ("dtype", "float32", "bfloat16")),
        ({"kv_cache_dtype": "int8"}, ("kv_cache_dtype", "int8")),
        ({"kv_cache_dtype": "float16"}, ("kv_cache_dtype", "bfloat16")),
    ],
)
def test_bad_device_or_dtype_is_named(model_zoo, kwargs, culprits):
    with pytest.raises(InvalidRequestError) as excinfo:
        detspec.LLM(str(model_zoo.get("llama").path), **kwargs)
    for culprit in culprits:
        assert culprit in str(excinfo.value), f"{culprit!r} not named in: {excinfo.value}"


def test_cuda_in_a_cpu_build_names_the_device(model_zoo):
    """A CPU wheel asked for a GPU says which device and what to do, instead of running on
    the CPU or crashing. (A CUDA wheel on a machine without a GPU says the device cannot be
    opened: tests/gpu/.)"""
    if detspec.built_with_cuda():
        pytest.skip("this is the CUDA wheel")
    for device in ("cuda", "cuda:1"):
        with pytest.raises(InvalidRequestError) as excinfo:
            detspec.LLM(str(model_zoo.get("llama").path), device=device)
        msg = str(excinfo.value)
        assert "device" in msg and "no CUDA backend" in msg, msg


def test_missing_model_dir(tmp_path):
    missing = tmp_path / "no-such-model"
    assert_load_error(missing, str(missing))


def test_missing_config_json(copy_model_dir):
    d = copy_model_dir("llama")
    (d / "config.json").unlink()
    assert_load_error(d, "config.json")


def test_invalid_config_json(copy_model_dir):
    d = copy_model_dir("llama")
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')
    assert_load_error(d, "config.json")


def test_unsupported_architecture(copy_model_dir):
    d = copy_model_dir("llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_load_error(d, "GPT2LMHeadModel")


def test_quantized_checkpoint_is_refused_naming_its_method(copy_model_dir):
    """An AWQ/GPTQ/FP8 checkpoint (vLLM serves them) is refused at its config, naming the
    method, before any tensor is read."""
    d = copy_model_dir("llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (d / "config.json").write_text(json.dumps(cfg))
    assert_load_error(d, "quantization_config.quant_method", "gptq", "unquantized")


def test_no_weights_file(copy_model_dir):
    d = copy_model_dir("llama")
    (d / "model.safetensors").unlink()
    assert_load_error(d, "safetensors")


@pytest.mark.parametrize("tensor", [UP_PROJ, "lm_head.weight", "model.norm.weight"])
def test_missing_tensor(copy_model_dir, tensor):
    d = copy_model_dir("llama")  # untied: lm_head.weight must be present
    resave(d / "model.safetensors", lambda t: t.pop(tensor))
    assert_load_error(d, tensor)


@pytest.mark.parametrize(
    ("tensor", "reshape"),
    [
        (UP_PROJ, lambda w: w.t().contiguous()),  # [128, 64] -> [64, 128]
        (
            "model.embed_tokens.weight",
            lambda w: w[:500].contiguous(),
        ),  # vocab 512 -> 500
        (
            "model.layers.1.self_attn.k_proj.weight",
            lambda w: torch.cat([w, w]),
        ),  # MHA shape
    ],
    ids=["transposed", "short-vocab", "kv-heads"],
)
def test_wrong_shape(copy_model_dir, tensor, reshape):
    d = copy_model_dir("llama")

    def edit(tensors):
        tensors[tensor] = reshape(tensors[tensor])

    resave(d / "model.safetensors", edit)
    assert_load_error(d, tensor)


def test_wrong_dtype(copy_model_dir):
    d = copy_model_dir("llama")
    name = "model.norm.weight"

    def edit(tensors):
        tensors[name] = torch.ones_like(tensors[name], dtype=torch.int32)

    resave(d / "model.safetensors", edit)
    assert_load_error(d, name)


def test_truncated_safetensors(copy_model_dir):
    d = copy_model_dir("llama")
    path = d / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    assert_load_error(d, "model.safetensors")


@pytest.mark.parametrize("how", ["garbage-file", "garbage-header-json"])
def test_corrupt_safetensors_header(copy_model_dir, how):
    d = copy_model_dir("llama")
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    if how == "garbage-file":
        data = bytearray(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8))
    else:  # keep the 8-byte length, garble the JSON header after it
        data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))
    assert_load_error(d, "model.safetensors")


def test_missing_shard(copy_model_dir):
    d = copy_model_dir("qwen2_sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (d / shard).unlink()
    assert_load_error(d, shard)


def test_shard_index_names_missing_tensor(copy_model_dir):
    d = copy_model_dir("qwen2_sharded")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    tensor = "model.layers.1.self_attn.q_proj.bias"
    shard = index["weight_map"][tensor]
    resave(d / shard, lambda t: t.pop(tensor))
    assert_load_error(d, tensor)


def test_loads_without_tokenizer_json(copy_model_dir, model_zoo, token_prompts):
    d = copy_model_dir("llama")
    (d / "tokenizer.json").unlink()
    llm = load_llm(d)  # a tokenizer is optional for token-id prompts
    case = model_zoo.get("llama")
    outs = llm.generate(token_prompts[:2], greedy())
    for prompt, out in zip(token_prompts[:2], outs, strict=True):
        case.assert_greedy_matches(prompt, list(out.outputs[0].token_ids), n=8)
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.generate("Hello", greedy())
    assert "tokenizer" in str(excinfo.value).lower()
    # still serving after the rejected text prompt
    again = llm.generate(token_prompts[:1], greedy())
    case.assert_greedy_matches(token_prompts[0], list(again[0].outputs[0].token_ids), n=8)


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("top_k", -2),
        ("min_p", 2.0),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("n", 0),
        ("min_tokens", -1),
    ],
)
def test_invalid_sampling_params(name, value):
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**{name: value})
    assert isinstance(excinfo.value, ValueError)
    assert name in str(excinfo.value), str(excinfo.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert "min_tokens" in str(excinfo.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": 0, "min_p": 0.0},
        {"top_p": 0.01, "top_k": 1, "min_p": 1.0},
        {"max_tokens": 1, "min_tokens": 1},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 2.0},
        {"seed": 0, "logprobs": 0},
        {"stop": ["a", "bc"], "stop_token_ids": [5]},
    ],
)
def test_valid_sampling_params_edges(kwargs):
    SamplingParams(**kwargs)


# --------------------------------------------------------------------------- bad requests


@pytest.fixture(scope="module")
def serving(model_zoo, tmp_path_factory):
    """A private engine on a copy of the llama dir, plus a health check."""
    case = model_zoo.get("llama")
    d = tmp_path_factory.mktemp("serving") / "llama"
    shutil.copytree(case.path, d)
    llm = load_llm(d)
    rng = np.random.default_rng(11)
    probes = [[int(t) for t in rng.integers(2, 512, size=n)] for n in (5, 20)]

    def check_still_serving():
        outs = llm.generate(probes, greedy())
        assert len(outs) == len(probes), "stale outputs from a failed call leaked"
        for probe, out in zip(probes, outs, strict=True):
            assert list(out.prompt_token_ids) == probe
            case.assert_greedy_matches(probe, list(out.outputs[0].token_ids), n=8)

    check_still_serving()
    return llm, check_still_serving


def _bad_request(serving, prompts, fragment="prompt", params=None):
    llm, check_still_serving = serving
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.generate(prompts, params if params is not None else greedy())
    assert isinstance(excinfo.value, DetspecError)
    assert fragment in str(excinfo.value).lower(), str(excinfo.value)
    check_still_serving()


def test_prompt_too_long(serving):
    _bad_request(serving, [[5] * 300])  # max_position_embeddings is 256


def test_prompt_longer_than_max_model_len(model_zoo):
    llm = detspec.LLM(str(model_zoo.get("llama").path), device="cpu", max_model_len=32)
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.generate([[5] * 40], greedy())
    assert "prompt" in str(excinfo.value).lower()


def test_token_id_out_of_vocab(serving):
    _bad_request(serving, [[3, 4, 512, 6]])


def test_empty_token_prompt(serving):
    _bad_request(serving, [[]])


def test_empty_text_prompt(serving):
    _bad_request(serving, [""])


def test_one_bad_prompt_fails_the_call_and_leaves_no_residue(serving):
    good = [7, 8, 9, 10]
    _bad_request(serving, [good, [1, 2, 100000], good])


def test_sampling_params_count_mismatch(serving):
    llm, check_still_serving = serving
    with pytest.raises(ValueError):
        llm.generate([[5, 6], [7, 8]], [greedy(), greedy(), greedy()])
    check_still_serving()


def test_model_dir_accepts_pathlike(model_zoo, token_prompts):
    case = model_zoo.get("llama")
    llm = detspec.LLM(case.path, device="cpu")  # a pathlib.Path, not a str
    out = llm.generate(token_prompts[:1], greedy())[0]
    case.assert_greedy_matches(token_prompts[0], list(out.outputs[0].token_ids), n=8)


@pytest.mark.parametrize(
    "name,value",
    [
        ("max_num_seqs", -1),
        ("page_size", 2.5),
        ("verify_window", -3),
        ("verify_group", 0),
        ("verify_finish_wait", -1),
        ("num_kv_pages", 0),
        ("num_threads", True),
    ],
)
def test_invalid_engine_parameters_name_the_parameter(llama_case, name, value):
    with pytest.raises(InvalidRequestError, match=name):
        detspec.LLM(llama_case.path, **{name: value})
