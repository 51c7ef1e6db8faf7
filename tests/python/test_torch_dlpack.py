"""DLPack both ways: engine tensors reach torch without a copy (the torch tensor's data_ptr is
the engine buffer's address), torch tensors reach the engine with one copy and their dtype,
and round trips keep every bit."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import detspec
from detspec import InvalidRequestError, SamplingParams
from detspec.torch import from_torch, to_torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
BITS_VIEW = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.int64: torch.int64,
    torch.int32: torch.int32,
}


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns: floats include NaNs (with payloads), infinities and subnormals."""
    g = torch.Generator().manual_seed(seed)
    bits = BITS_VIEW[dtype]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=bits).view(dtype)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(BITS_VIEW[a.dtype]), b.view(BITS_VIEW[b.dtype]))


@pytest.fixture(scope="module")
def llm(model_zoo) -> detspec.LLM:
    return detspec.LLM(str(model_zoo.get("llama").path), num_kv_pages=64)


def capsule_name(capsule: object) -> bytes:
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    return get_name(capsule)


def test_engine_tensors_reach_torch_without_a_copy(llm):
    (t,) = llm._engine.prompt_logits([[1, 2, 3, 4]])
    x = to_torch(t)
    assert x.data_ptr() == t.data_ptr and tuple(x.shape) == t.shape == (4, 512)
    assert x.dtype == torch.float32 and t.dtype == "float32"
    # Writes through one view are visible through another view of the same buffer: the
    # buffer belongs to this output tensor, not to the engine's state.
    x[0, 0] = 12345.0
    assert to_torch(t)[0, 0].item() == 12345.0
    # The torch view outlives the engine object.
    want = x.clone()
    del t
    gc.collect()
    assert torch.equal(x, want)


def test_both_capsule_kinds_and_export_arguments(llm):
    (t,) = llm._engine.prompt_logits([[5, 6]])
    legacy, versioned = t.__dlpack__(), t.__dlpack__(max_version=(1, 0))
    assert capsule_name(legacy) == b"dltensor"
    assert capsule_name(versioned) == b"dltensor_versioned"
    from torch.utils.dlpack import from_dlpack

    assert torch.equal(from_dlpack(legacy), from_dlpack(versioned))
    assert t.__dlpack_device__() == (1, 0)
    del t
    unused = llm._engine.prompt_logits([[7]])[0].__dlpack__(max_version=(1, 0))
    del unused  # an unconsumed capsule frees its tensor
    (t,) = llm._engine.prompt_logits([[5, 6]])
    for kwargs in ({"stream": 1}, {"dl_device": (2, 0)}, {"copy": True}):
        with pytest.raises(BufferError):
            t.__dlpack__(**kwargs)
    assert t.__dlpack__(dl_device=(1, 0), copy=False) is not None


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    transpose=st.booleans(),
)
def test_round_trips_keep_every_bit(shape, dtype, seed, transpose):
    x = random_tensor(shape, dtype, seed)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, 1)  # strided input: copied once, in row-major order
    e = from_torch(x)
    assert e.shape == tuple(x.shape)
    back = to_torch(e)
    assert back.is_contiguous()
    assert_same_bits(back, x.contiguous())


def test_import_is_one_copy_of_the_same_dtype():
    x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    e = from_torch(x)
    assert e.dtype == "bfloat16" and e.data_ptr != x.data_ptr()
    x[0, 0] = 99  # the engine's copy does not follow
    assert to_torch(e)[0, 0].item() == 0
    # requires_grad: detached first (a view), then copied.
    w = torch.ones(3, requires_grad=True)
    assert torch.equal(to_torch(from_torch(w)), torch.ones(3))


class FakeCuda:
    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kwargs):
        raise AssertionError("must not be called")


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(3, dtype=torch.float64), "unsupported dtype"),
        (torch.zeros(3, dtype=torch.uint8), "unsupported dtype"),
        (torch.zeros(3, dtype=torch.bool), "unsupported dtype"),
        ([1.0, 2.0], "not a tensor"),
        (FakeCuda(), "only CPU"),
    ],
)
def test_bad_imports_name_the_tensor(bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        from_torch(bad)


def test_update_weights_rejects_integer_weights_naming_them(model_zoo):
    llm = detspec.LLM(str(model_zoo.get("llama").path), num_kv_pages=64)
    fp = llm.fingerprint
    with pytest.raises(InvalidRequestError, match="model.norm.weight.*int64"):
        llm.update_weights([("model.norm.weight", torch.zeros(64, dtype=torch.int64))])
    with pytest.raises(InvalidRequestError, match="model.norm.weight.*unsupported dtype"):
        llm.update_weights([("model.norm.weight", torch.zeros(64, dtype=torch.float64))])
    assert llm.fingerprint == fp


def test_request_output_to_torch(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, deterministic=True)
    out = llm.generate([[3, 4, 5]], params, use_tqdm=False)[0]
    ((ids, lps),) = out.to_torch()
    assert ids.dtype == torch.int64 and ids.tolist() == out.outputs[0].token_ids
    assert lps.dtype == torch.float32
    assert lps.tolist() == out.outputs[0].token_logprobs  # f32 values, exactly


def test_import_detspec_does_not_import_torch():
    code = "import sys, detspec; detspec.SamplingParams(); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
