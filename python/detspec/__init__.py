"""detspec: LLM inference with per-request bitwise-reproducible output under dynamic batching."""

from detspec.async_llm import AsyncLLM
from detspec.errors import DetspecError, InvalidRequestError, ModelLoadError
from detspec.llm import LLM, Tokenizer
from detspec.outputs import CompletionOutput, Logprob, RequestOutput
from detspec.sampling_params import SamplingParams

__all__ = [
    "AsyncLLM",
    "LLM",
    "CompletionOutput",
    "DetspecError",
    "InvalidRequestError",
    "Logprob",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "Tokenizer",
    "built_with_cuda",
    "cuda_available",
]
__version__ = "0.1.0"


def cuda_available() -> bool:
    """Whether this build has the CUDA backend and a GPU it can open (``device="cuda"``)."""
    from detspec import _core

    return bool(_core.CUDA_BUILD) and _core.cuda_device_count() > 0


def built_with_cuda() -> bool:
    """Whether this is the CUDA wheel (scripts/build-cuda-wheel.sh), GPU or not."""
    from detspec import _core

    return bool(_core.CUDA_BUILD)
