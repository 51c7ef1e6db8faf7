"""The offline entry point, ``LLM``, shaped like vLLM's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from detspec import _core
from detspec.errors import InvalidRequestError
from detspec.outputs import RequestOutput, request_output_from_dict
from detspec.sampling_params import SamplingParams, _as_params_list

PromptType = str | list[int] | dict[str, Any]


class Tokenizer:
    """The model's tokenizer (``tokenizer.json``), run by the Rust core."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._engine.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._engine.decode(list(token_ids), skip_special_tokens)


def _normalise_prompts(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int]]:
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        prompts = [list(prompts)]  # one prompt given as token ids
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append([int(t) for t in p["prompt_token_ids"]])
            elif "prompt" in p:
                out.append(str(p["prompt"]))
            else:
                raise InvalidRequestError(
                    f"invalid request: prompt {i} is a dict without `prompt` or `prompt_token_ids`"
                )
        elif isinstance(p, str):
            out.append(p)
        elif isinstance(p, Sequence) and all(isinstance(t, int | np.integer) for t in p):
            out.append([int(t) for t in p])
        else:
            raise InvalidRequestError(
                f"invalid request: prompt {i} must be a string, a list of token ids or a dict, "
                f"got {type(p).__name__}"
            )
    return out


class LLM:
    """Loads a Hugging Face model directory and generates from it.

    ``model=None`` uses the built-in tiny demo model (built on first use, no download).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        device: str = "cpu",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        num_kv_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        max_model_len: int | None = None,
    ) -> None:
        if device != "cpu":
            raise InvalidRequestError(
                f"invalid parameter `device`: {device!r} is not available in this build "
                "(supported: 'cpu')"
            )
        if model is None:
            from detspec.default_model import default_model_dir

            model = default_model_dir()
        self.model = os.fspath(model)
        self._engine = _core.Engine(
            self.model,
            page_size=page_size,
            num_kv_pages=num_kv_pages,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        self._next_id = 0
        self.tokenizer = Tokenizer(self._engine) if self._engine.has_tokenizer() else None

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    @property
    def fingerprint(self) -> str:
        return self._engine.fingerprint()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates a completion for every prompt; all prompts run together in one batch.

        Outputs are returned in prompt order.
        """
        del use_tqdm  # progress reporting arrives with the continuous-batching engine
        plist = _normalise_prompts(prompts)
        params = _as_params_list(sampling_params, len(plist))
        reqs = []
        for p, sp in zip(plist, params, strict=True):
            reqs.append((str(self._next_id), p, sp.to_dict()))
            self._next_id += 1
        raw = self._engine.generate(reqs)
        decode = self._decode_token
        return [
            request_output_from_dict(d, sp.logprobs, decode)
            for d, sp in zip(raw, params, strict=True)
        ]

    def _decode_token(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def compute_logits(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per-position logits ``[len_i, vocab]`` of each token-id prompt, all in one batch."""
        return self._engine.prompt_logits([[int(t) for t in p] for p in prompts])

    def kv_pages(self) -> tuple[int, int]:
        """``(free, total)`` KV-cache pages."""
        return self._engine.kv_pages()
