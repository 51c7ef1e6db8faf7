"""Scoring and audit results: vLLM-shaped prompt logprobs and the report of ``LLM.audit``."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from detspec.outputs import Logprob, RequestOutput

# (token, logprob, rank, top) as the Rust core returns it for one position.
RawLogprob = tuple[int, float, int, list[tuple[int, float]]]


def prompt_logprobs_to_py(
    raw: list[RawLogprob], decode: Callable[[int], str | None]
) -> list[dict[int, Logprob] | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then per position the
    prompt token's logprob and the top-k, each as ``{token_id: Logprob}``."""
    out: list[dict[int, Logprob] | None] = [None]
    for token, lp, rank, top in raw:
        d: dict[int, Logprob] = {token: Logprob(lp, rank, decode(token))}
        for r, (t, tlp) in enumerate(top, start=1):
            d.setdefault(t, Logprob(tlp, r, decode(t)))
        out.append(d)
    return out


@dataclass(frozen=True)
class Mismatch:
    """The first place a re-run disagreed with a stored output."""

    completion: int
    """Index of the completion (``CompletionOutput.index``)."""
    position: int
    """Output position (0 = first generated token); -1 for the cumulative logprob."""
    field: str
    """``"token_id"``, ``"logprob"`` or ``"cumulative_logprob"``."""
    stored: int | float
    recomputed: int | float


@dataclass(frozen=True)
class AuditReport:
    """Result of ``LLM.audit``: whether a stored output is exactly what this engine produces."""

    ok: bool
    fingerprint: str
    num_tokens: int
    """Tokens checked, over all completions."""
    first_mismatch: Mismatch | None = None

    def __bool__(self) -> bool:
        return self.ok


def _bits(x: float) -> int:
    """The f32 bit pattern of a logprob (logprobs are f32 values carried in Python floats)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def compare(output: RequestOutput, redrawn: list[list[RawLogprob]]) -> AuditReport:
    """Compares each completion's stored token ids and logprobs (per token where the output
    has them, and the cumulative logprob) with what the re-run drew, bit for bit."""
    checked = 0
    for c, again in zip(output.outputs, redrawn, strict=True):
        stored_lps = c.token_logprobs
        cumulative = 0.0
        for pos, (token, (new_token, new_lp, _, _)) in enumerate(
            zip(c.token_ids, again, strict=True)
        ):
            checked += 1
            if token != new_token:
                return _fail(output, checked, Mismatch(c.index, pos, "token_id", token, new_token))
            if stored_lps is not None and _bits(stored_lps[pos]) != _bits(new_lp):
                mismatch = Mismatch(c.index, pos, "logprob", stored_lps[pos], new_lp)
                return _fail(output, checked, mismatch)
            cumulative += new_lp
        if c.cumulative_logprob is not None and c.cumulative_logprob != cumulative:
            mismatch = Mismatch(c.index, -1, "cumulative_logprob", c.cumulative_logprob, cumulative)
            return _fail(output, checked, mismatch)
    return AuditReport(True, output.fingerprint, checked)


def _fail(output: RequestOutput, checked: int, m: Mismatch) -> AuditReport:
    return AuditReport(False, output.fingerprint, checked, m)


def params_for_audit(output: RequestOutput, sampling_params: Any) -> Any:
    """The parameters an output was generated with: given, or recorded on the output."""
    params = sampling_params if sampling_params is not None else output.sampling_params
    if params is None:
        from detspec.errors import InvalidRequestError

        raise InvalidRequestError(
            "invalid parameter `sampling_params`: the output does not record its sampling "
            "parameters; pass the ones it was generated with",
            param="sampling_params",
        )
    return params
