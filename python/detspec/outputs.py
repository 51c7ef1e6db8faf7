"""Outputs shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    """Log-probability of one token, with its rank in the model's distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_logprobs: list[float] | None = None
    """The logprob of each generated token (raw logits, as ``logprobs``), whether or not
    ``logprobs`` was requested: what ``LLM.score`` reproduces and ``LLM.audit`` checks."""

    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_torch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids, logprobs)``: int64 and float32 tensors of length ``len(token_ids)``;
        the logprobs are ``token_logprobs`` (the sampled tokens', bit for bit)."""
        import torch

        lps = self.token_logprobs if self.token_logprobs is not None else []
        return (
            torch.tensor(self.token_ids, dtype=torch.int64),
            torch.tensor(lps, dtype=torch.float32),
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    fingerprint: str
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: vLLM's format (``None`` first, then per prompt
    position ``{token_id: Logprob}`` for the prompt token and the top-k)."""
    sampling_params: Any = None
    """The ``SamplingParams`` the request ran with (what ``LLM.audit`` re-runs)."""
    num_cached_tokens: int = 0
    """Prompt tokens read from the prefix cache instead of computed (vLLM's field)."""

    def to_torch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``CompletionOutput.to_torch()`` of each completion, in order."""
        return [c.to_torch() for c in self.outputs]


@dataclass
class EmbeddingOutput:
    embedding: list[float]
    """The pooled last-layer hidden state (float32 values), cut and normalised as asked."""


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, shaped like vLLM's ``EmbeddingRequestOutput``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    fingerprint: str
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]
    """softmax of the labels' logits (the logistic function of a single one), as vLLM's."""
    logits: list[float]
    """The ``score`` layer's output at the last token, one per label (detspec's addition)."""
    label: str
    """The name (``id2label``) of the most probable label (the first of any tie)."""


@dataclass
class ClassificationRequestOutput:
    """One prompt's classification, shaped like vLLM's ``ClassificationRequestOutput``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    fingerprint: str
    finished: bool = True


@dataclass
class PoolingOutput:
    data: list[float]
    """A reward model's raw output: the ``score`` layer at the last token, one per label."""


@dataclass
class PoolingRequestOutput:
    """One prompt's reward, shaped like vLLM's ``PoolingRequestOutput`` of ``LLM.reward``
    (``data`` is a list of float32 values, not a tensor)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    fingerprint: str
    finished: bool = True


def _logprobs_to_py(
    raw: list[tuple[int, float, int, list[tuple[int, float]]]],
    num: int | None,
    decode: Any,
) -> list[dict[int, Logprob]] | None:
    if num is None:
        return None
    out = []
    for token, lp, rank, top in raw:
        d: dict[int, Logprob] = {token: Logprob(lp, rank, decode(token))}
        for r, (t, tlp) in enumerate(top, start=1):
            if t not in d:
                d[t] = Logprob(tlp, r, decode(t))
        out.append(d)
    return out


def request_output_from_dict(
    d: dict[str, Any], num_logprobs: int | None, decode: Any
) -> RequestOutput:
    outs = [
        CompletionOutput(
            index=c["index"],
            text=c["text"],
            token_ids=list(c["token_ids"]),
            cumulative_logprob=c["cumulative_logprob"],
            logprobs=_logprobs_to_py(c["logprobs"], num_logprobs, decode),
            finish_reason=c["finish_reason"],
            stop_reason=c["stop_reason"],
            token_logprobs=[lp for _, lp, _, _ in c["logprobs"]],
        )
        for c in d["outputs"]
    ]
    return RequestOutput(
        request_id=d["request_id"],
        prompt=d["prompt"],
        prompt_token_ids=list(d["prompt_token_ids"]),
        outputs=outs,
        finished=d["finished"],
        fingerprint=d["fingerprint"],
        metrics=dict(d.get("metrics") or {}),
        num_cached_tokens=int((d.get("metrics") or {}).get("num_cached_tokens", 0)),
    )
