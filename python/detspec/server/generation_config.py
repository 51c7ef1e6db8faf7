"""The model's sampling defaults (``generation_config.json``), as vLLM serves them.

vLLM applies a model's recommended sampling settings to requests that leave them unset
(``--generation-config auto``, its default): a Qwen3 or Llama-3.1-Instruct request without
``temperature`` samples at the model's 0.6 or 0.7, not at 1.0. An eval that compares detspec
with vLLM on such a model must get the same defaults, so the server reads them the same way:

* ``auto``: ``<model>/generation_config.json``; ``vllm``: none (every request default is the
  OpenAI one); any other value: a directory holding a ``generation_config.json``;
* as transformers' ``GenerationConfig.to_diff_dict`` (which vLLM reads), a value equal to
  transformers' own default is not a default (a file's ``"top_k": 50`` or ``"temperature": 1.0``
  changes nothing), and ``do_sample`` is ignored, as vLLM ignores it;
* ``--override-generation-config`` (JSON) is laid over the file, its values kept as given;
* of the result, the sampling fields a request has: temperature, top_p, top_k, min_p, the
  three penalties, and ``max_new_tokens`` as the default ``max_tokens``.

The defaults are checked once at start-up by the engine's own ``SamplingParams`` (an
impossible value is a start-up error naming the file), so a request never fails for a value
it did not send.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

# transformers' GenerationConfig defaults of the fields below (``to_diff_dict`` drops values
# equal to them); the others default to None there.
_TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "repetition_penalty": 1.0,
}
# generation_config.json field -> request field.
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
}
FILE_NAME = "generation_config.json"


class GenerationConfigError(ValueError):
    """A generation config that cannot be served; the message names the file and field."""


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise GenerationConfigError(f"{path}: cannot read: {e}") from None
    except ValueError as e:
        raise GenerationConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    return data


def sampling_defaults(
    source: str, model_dir: str, override: dict[str, Any] | None = None
) -> dict[str, float | int]:
    """The request defaults of ``--generation-config source`` (``auto``, ``vllm`` or a
    directory) for the model in ``model_dir``, with ``override`` laid over them; keyed by
    request field."""
    config: dict[str, Any] = {}
    if source != "vllm":
        path = os.path.join(model_dir if source == "auto" else source, FILE_NAME)
        if source != "auto" and not os.path.isfile(path):
            raise GenerationConfigError(f"--generation-config {source}: no {FILE_NAME} there")
        if os.path.isfile(path):
            config = {
                k: v
                for k, v in _read(path).items()
                if k not in _TRANSFORMERS_DEFAULTS or v != _TRANSFORMERS_DEFAULTS[k]
            }
    config.update(override or {})
    out: dict[str, float | int] = {}
    for name, field in _FIELDS.items():
        value = config.get(name)
        if value is None:
            continue
        ok_type = int if name in ("top_k", "max_new_tokens") else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_type):
            raise GenerationConfigError(
                f"generation config field {name}: expected a number, found {value!r}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise GenerationConfigError(f"generation config field {name}: {value} is not finite")
        out[field] = value
    return out


def check(defaults: dict[str, float | int]) -> None:
    """Raises ``GenerationConfigError`` if the engine would refuse a request carrying these
    defaults (the engine's own validation, not a second copy of its rules)."""
    from detspec import SamplingParams
    from detspec.errors import DetspecError

    fields = {k: v for k, v in defaults.items() if k != "max_tokens"}
    max_tokens = defaults.get("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise GenerationConfigError(f"generation config field max_new_tokens: {max_tokens} < 1")
    try:
        SamplingParams(**fields)
    except (DetspecError, ValueError, TypeError) as e:
        raise GenerationConfigError(f"generation config: {e}") from None


def fingerprint_suffix(
    defaults: dict[str, float | int], model_defaults: dict[str, float | int]
) -> str:
    """``+gen<hash>`` where the defaults are not the model's own (``--generation-config vllm``
    or a directory, or an override): a request without these fields then gets other outputs
    than the model's fingerprint (which covers its ``generation_config.json``) implies."""
    if defaults == model_defaults:
        return ""
    canonical = json.dumps(defaults, sort_keys=True)
    return "+gen" + hashlib.sha256(canonical.encode()).hexdigest()[:8]
