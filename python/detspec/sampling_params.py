"""Sampling parameters, with vLLM's names and defaults plus ``deterministic``."""

from __future__ import annotations

import dataclasses
import json as _json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from detspec import _core


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's ``StructuredOutputsParams``); set exactly one field.

    Compiled by llguidance against the model's vocabulary; a constrained request is as
    reproducible as any other (the mask is a function of the tokens so far)."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (a dict, or its JSON text)."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect; ``%json{...}`` embeds a JSON schema)."""
    json_object: bool | None = None
    """Any JSON object."""
    starts_after: int | list[int] | None = None
    """A token id, or a run of them: the constraint applies to the output after its first
    occurrence, which the model reaches freely (a reasoning model's ``</think>``; gpt-oss's
    ``<|channel|>final<|message|>``): the thinking is free, the answer constrained. Not a
    constraint of its own."""

    def to_dict(self) -> dict[str, Any]:
        """The fields the Rust core reads."""
        return _structured_dict(vars(self))


def _structured_dict(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that are set, a schema dict as JSON text (unknown keys are kept for the
    core to name in its error)."""
    d = {k: v for k, v in fields.items() if v is not None}
    if isinstance(d.get("json"), Mapping):
        d["json"] = _json.dumps(d["json"])
    return d


@dataclass
class SamplingParams:
    """How to sample one request. Validated on construction (by the Rust core, so Python and
    Rust accept exactly the same values); invalid values raise ``InvalidRequestError``.

    ``deterministic=True`` (alias ``is_deterministic``) asks for bitwise-reproducible output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the output at the end of ``text`` (vLLM's); the token
    ids are the same either way."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    deterministic: bool = False
    prompt_logprobs: int | None = None
    """Logprobs of the prompt tokens with this many top alternatives (vLLM's format, in
    ``RequestOutput.prompt_logprobs``), computed on the verify-path kernels."""
    skip_special_tokens: bool = True
    """Leave special tokens out of ``text`` (vLLM's default); ``token_ids`` always have them.
    Stop strings match the text as written."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling (OpenAI's range [-100, 100])."""
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled (vLLM's); the reported logprobs are the model's."""
    bad_words: list[str] | None = None
    """Words the output never contains (vLLM's): the token that would complete one is banned
    (each word tokenized as written and with a leading space)."""
    is_deterministic: dataclasses.InitVar[bool | None] = None
    _extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self, is_deterministic: bool | None) -> None:
        if is_deterministic is not None:
            self.deterministic = bool(is_deterministic)
        _core.validate_sampling_params(self.to_dict())
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or self.prompt_logprobs < 0
        ):
            from detspec.errors import InvalidRequestError

            raise InvalidRequestError(
                f"invalid parameter `prompt_logprobs`: must be a non-negative integer (at "
                f"most the engine's max_logprobs), got {self.prompt_logprobs!r}",
                param="prompt_logprobs",
            )

    def to_dict(self) -> dict[str, Any]:
        """The fields the Rust core reads."""
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("_extra", "prompt_logprobs")
        }
        if isinstance(d["stop"], str):
            d["stop"] = [d["stop"]]
        d["stop"] = list(d["stop"] or [])
        d["stop_token_ids"] = list(d["stop_token_ids"] or [])
        d["logit_bias"] = dict(d["logit_bias"] or {})
        d["bad_words"] = list(d["bad_words"] or [])
        if d["allowed_token_ids"] is not None:
            d["allowed_token_ids"] = list(d["allowed_token_ids"])
        so = self.structured_outputs
        if isinstance(so, StructuredOutputsParams):
            d["structured_outputs"] = so.to_dict()
        elif isinstance(so, Mapping):
            d["structured_outputs"] = _structured_dict(so)
        return d

    def clone(self) -> SamplingParams:
        return dataclasses.replace(self)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        from detspec.errors import InvalidRequestError

        raise InvalidRequestError(
            f"invalid parameter `sampling_params`: got {len(params)} for {n} prompts",
            param="sampling_params",
        )
    return params
