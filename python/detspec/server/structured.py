"""Constraints and biases of a request, as engine parameters.

A request may constrain its output in one of several spellings: OpenAI's ``response_format``,
vLLM's ``structured_outputs`` extra, vLLM's older ``guided_*`` extras, or (chat) a
``tool_choice`` of ``required`` or a named function. Each becomes one
``detspec.StructuredOutputsParams``; more than one is a 400 naming them. The engine validates
what it is given (a schema, a regex, a grammar) and names the field it found wrong as
``structured_outputs.<field>``; ``Constraint.http_param`` turns that back into the field the
client sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from detspec.errors import InvalidRequestError
from detspec.sampling_params import StructuredOutputsParams
from detspec.server import protocol as P
from detspec.server.errors import ApiError, invalid

# vLLM's older extras: request field -> StructuredOutputsParams field
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_json_object": "json_object",
}
ENGINE_PREFIX = "structured_outputs"


@dataclass
class Constraint:
    """One constraint: the engine's fields and the request field they came from."""

    fields: dict[str, Any]
    # StructuredOutputsParams field -> the request field a client sees in an error
    params: dict[str, str]
    # what the client sent (for the "more than one" error)
    source: str
    # the constraint starts after these tokens (a reasoning model's end of thinking)
    starts_after: tuple[int, ...] | None = None
    # it describes the whole output, reasoning included (a Harmony tool call's grammar):
    # never gated by a reasoning parser
    whole_output: bool = False

    def engine_params(self) -> StructuredOutputsParams:
        gate = list(self.starts_after) if self.starts_after is not None else None
        return StructuredOutputsParams(**self.fields, starts_after=gate)

    def after_tokens(self, tokens: Sequence[int]) -> Constraint:
        """This constraint, applied to the output after the first run of ``tokens`` only."""
        return dataclasses.replace(self, starts_after=tuple(tokens))

    def http_param(self, engine_param: str | None) -> str:
        """The request field behind an engine error's ``param``."""
        if engine_param and engine_param.startswith(ENGINE_PREFIX):
            field = engine_param[len(ENGINE_PREFIX) + 1 :]
            return self.params.get(field, self.source)
        return engine_param or self.source


def constraint_invalid(
    e: InvalidRequestError, constraint: Constraint | None, default_param: str | None = None
) -> ApiError:
    """A 400 for an engine error, naming the request field behind it."""
    if constraint is not None and (e.param or "").startswith(ENGINE_PREFIX):
        param = constraint.http_param(e.param)
        return ApiError(400, str(e).replace(f"`{e.param}`", f"`{param}`"), param)
    return invalid(e, default_param)


def request_constraints(req: P._SamplingFields) -> list[Constraint]:
    """The constraints ``req`` sends through ``response_format``, ``structured_outputs`` and
    ``guided_*`` (a ``{"type": "text"}`` format is none)."""
    out: list[Constraint] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(Constraint({"json_object": True}, {}, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise ApiError(
                400,
                "response_format of type json_schema needs `json_schema` "
                '({"name": ..., "schema": {...}})',
                "response_format.json_schema",
            )
        param = "response_format.json_schema.schema"
        out.append(Constraint({"json": rf.json_schema.schema_}, {"json": param}, param))
    so = req.structured_outputs
    if so is not None:
        fields = so.model_dump(by_alias=True, exclude_none=True)
        if not fields:
            raise ApiError(
                400,
                "structured_outputs sets no constraint: give one of json, regex, choice, "
                "grammar, json_object",
                "structured_outputs",
            )
        names = {k: f"{ENGINE_PREFIX}.{k}" for k in fields}
        out.append(Constraint(fields, names, ENGINE_PREFIX))
    for name, field in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None and value is not False:
            out.append(Constraint({field: value}, {field: name}, name))
    return out


def single(constraints: list[Constraint]) -> Constraint | None:
    """The request's one constraint; a 400 naming them when there are several."""
    if len(constraints) > 1:
        names = ", ".join(c.source for c in constraints)
        raise ApiError(
            400,
            f"a request takes one output constraint; got {len(constraints)}: {names}",
            constraints[1].source,
        )
    return constraints[0] if constraints else None


def logit_bias(bias: dict[str, Any] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as strings) as the engine's ``{int: float}``; the
    engine checks the ids against the vocabulary and the biases against [-100, 100]."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise ApiError(
                400,
                f"logit_bias keys must be token ids (non-negative integers as strings), "
                f"got {key!r}",
                "logit_bias",
            )
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ApiError(
                400,
                f"logit_bias values must be numbers, got {value!r} for token {key}",
                "logit_bias",
            )
        out[int(key)] = float(value)
    return out
