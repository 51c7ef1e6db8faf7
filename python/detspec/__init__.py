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
]
__version__ = "0.1.0"
