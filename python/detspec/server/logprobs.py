"""Logprobs in OpenAI's shapes: completions' ``tokens``/``token_logprobs``/``top_logprobs``/
``text_offset``, chat's ``content`` list with UTF-8 ``bytes``, vLLM's ``prompt_logprobs``.

Floats go out exactly: the engine's f32 values as Python floats, which ``json.dumps`` writes
as the shortest repr that reads back to the same double, so a client recovers the f32 bit
for bit. JSON has no infinity: -inf becomes vLLM's stand-in, -9999.0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

# vLLM's stand-in for a -inf logprob (JSON has no infinity).
NEG_INF_LOGPROB = -9999.0


def json_logprob(x: float) -> float:
    return x if x > -math.inf else NEG_INF_LOGPROB


def token_bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def split_logprobs(d: dict[int, Any], k: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(chosen token, its logprob, top-k [(token, logprob)] in rank order) of one position's
    ``{token_id: Logprob}`` (the chosen token first)."""
    items = list(d.items())
    tok, chosen = items[0]
    top = sorted(
        ((t, lp) for t, lp in items if lp.rank is not None and 1 <= lp.rank <= k),
        key=lambda x: x[1].rank,
    )
    return tok, chosen.logprob, [(t, lp.logprob) for t, lp in top]


class LogprobShaper:
    """Shapes the engine's per-position logprobs; ``decode_token`` names a token."""

    def __init__(self, decode_token: Callable[[int], str]) -> None:
        self.decode_token = decode_token

    def name(self, t: int, as_ids: bool) -> str:
        return f"token_id:{t}" if as_ids else self.decode_token(t)

    def completion(
        self, lps: list[dict[int, Any]], k: int, offset: int, as_ids: bool
    ) -> dict[str, Any]:
        """Completions' logprobs; ``offset`` is the text offset of the first token."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for d in lps:
            tok, lp, top = split_logprobs(d, k)
            s = self.name(tok, as_ids)
            tokens.append(s)
            token_lps.append(json_logprob(lp))
            entry = {s: json_logprob(lp)}
            for t, tlp in top:
                entry.setdefault(self.name(t, as_ids), json_logprob(tlp))
            tops.append(entry)
            offsets.append(offset)
            offset += len(self.decode_token(tok))
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat(self, lps: list[dict[int, Any]], k: int, as_ids: bool) -> dict[str, Any]:
        content = []
        for d in lps:
            tok, lp, top = split_logprobs(d, k)
            content.append(
                {
                    "token": self.name(tok, as_ids),
                    "logprob": json_logprob(lp),
                    "bytes": token_bytes(self.decode_token(tok)),
                    "top_logprobs": [
                        {
                            "token": self.name(t, as_ids),
                            "logprob": json_logprob(tlp),
                            "bytes": token_bytes(self.decode_token(t)),
                        }
                        for t, tlp in top
                    ],
                }
            )
        return {"content": content}

    @staticmethod
    def prompt(entries: list[dict[int, Any] | None]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` as JSON (``{"<id>": {logprob, rank, decoded_token}}``
        per position, None for the first)."""
        return [
            None
            if e is None
            else {
                str(t): {
                    "logprob": json_logprob(x.logprob),
                    "rank": x.rank,
                    "decoded_token": x.decoded_token,
                }
                for t, x in e.items()
            }
            for e in entries
        ]
