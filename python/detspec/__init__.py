"""detspec: LLM inference with per-request bitwise-reproducible output under dynamic batching."""

try:
    from detspec import _core  # noqa: F401  (the extension; loaded once, here)
except ImportError as e:
    if "libcu" in str(e):
        raise ImportError(
            f"{e}: this is detspec's CUDA build, which needs the NVIDIA driver and the CUDA 13 "
            "libraries torch 2.11+cu130 installs (pip install torch); on a machine without a "
            "GPU install the CPU wheel"
        ) from e
    raise

from detspec.async_llm import AsyncLLM  # noqa: E402
from detspec.errors import (
    DetspecError,
    EngineStoppedError,
    InvalidRequestError,
    ModelLoadError,
)
from detspec.llm import LLM, Tokenizer
from detspec.lora import LoRARequest
from detspec.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from detspec.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "AsyncLLM",
    "LLM",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "DetspecError",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineStoppedError",
    "InvalidRequestError",
    "Logprob",
    "LoRARequest",
    "ModelLoadError",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
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
