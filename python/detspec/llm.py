"""The offline entry point, ``LLM``, shaped like vLLM's."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from detspec import _core
from detspec.engine_args import ENGINE_SETTINGS, engine_settings_doc, resolve_engine_settings
from detspec.errors import InvalidRequestError
from detspec.lora import LoRARequest, LoRAType
from detspec.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    request_output_from_dict,
)
from detspec.sampling_params import SamplingParams, _as_params_list
from detspec.scoring import AuditReport, compare, params_for_audit, prompt_logprobs_to_py

if TYPE_CHECKING:
    import torch

PromptType = str | list[int] | dict[str, Any]
ChatMessage = Mapping[str, Any]


class Tokenizer:
    """The model's tokenizer (``tokenizer.json``), run by the Rust core."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._engine.encode(text, add_special_tokens)

    def encode_pair(self, text: str, text_pair: str, add_special_tokens: bool = True) -> list[int]:
        """The two texts as one sequence pair, joined by the tokenizer's pair template, as
        transformers' ``tokenizer(text, text_pair)`` (a cross-encoder's input)."""
        return self._engine.encode_pair(text, text_pair, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._engine.decode(list(token_ids), skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Renders a conversation with the model's chat template (minijinja, in Rust), or with
        ``chat_template`` (a Jinja source) where given, as transformers'
        ``apply_chat_template`` does; extra keyword arguments (``tools``,
        ``enable_thinking``, ...) become template variables. ``tokenize=True`` returns token
        ids (encoded without adding special tokens: the template writes them).
        ``continue_final_message``: the text ends with the last message's content, as
        transformers cuts it (what the template writes after it, an end-of-turn token, is
        left out), so that a model continues it; it needs ``add_generation_prompt=False``."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "invalid parameter `continue_final_message`: it continues the last message; "
                "set add_generation_prompt to false with it",
                param="continue_final_message",
            )
        try:
            if continue_final_message:
                conversation = _marked(conversation)
            messages = json.dumps([dict(m) for m in conversation])
            extra = json.dumps(kwargs) if kwargs else None
        except InvalidRequestError:
            raise
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(
                f"invalid parameter `messages`: each message must be a JSON-serialisable mapping "
                f"({e})",
                param="messages",
            ) from None
        text = self._engine.apply_chat_template(
            messages, add_generation_prompt, extra, chat_template
        )
        if continue_final_message:
            text = _cut_at_mark(text, len(conversation) - 1)
        return self.encode(text, add_special_tokens=False) if tokenize else text


# Appended to the last message for ``continue_final_message``: the rendering is cut where it
# lands (transformers marks the message the same way).
_CONTINUE_MARK = "DETSPEC_CONTINUE_FINAL_MESSAGE "


def _marked(conversation: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation with the mark after the last message's content (its last text part
    when the content is a list of parts)."""
    conv = [dict(m) for m in conversation]
    if not conv:
        raise InvalidRequestError(
            "invalid parameter `messages`: continue_final_message needs a message to continue",
            param="messages",
        )
    last = conv[-1]
    content = last.get("content")
    param = f"messages[{len(conv) - 1}].content"
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_MARK
        return conv
    parts = [dict(p) if isinstance(p, Mapping) else p for p in content or []]
    for part in reversed(parts):
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            part["text"] += _CONTINUE_MARK
            last["content"] = parts
            return conv
    raise InvalidRequestError(
        f"invalid parameter `{param}`: continue_final_message needs text to continue",
        param=param,
    )


def _cut_at_mark(text: str, index: int) -> str:
    """The rendering up to the mark: as written when the template kept the message whole,
    without trailing whitespace when it trimmed it (the mark's space gone)."""
    at = text.rfind(_CONTINUE_MARK.strip())
    if at < 0:
        param = f"messages[{index}].content"
        raise InvalidRequestError(
            f"invalid parameter `{param}`: continue_final_message: the chat template does not "
            "write the last message's content as given, so it cannot be continued",
            param=param,
        )
    kept = text[at : at + len(_CONTINUE_MARK)] == _CONTINUE_MARK
    return text[:at] if kept else text[:at].rstrip()


def _safetensors_bytes(tensors: Mapping[str, Any]) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (torch tensors or numpy arrays)."""
    first = next(iter(tensors.values()), None)
    if first is not None and type(first).__module__.startswith("torch"):
        from safetensors.torch import save

        return save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    from safetensors.numpy import save as save_numpy

    return save_numpy({k: np.ascontiguousarray(v) for k, v in tensors.items()})


def _json_default(value: Any) -> Any:
    """JSON for what a PEFT config's dict holds besides JSON types (sets of module names,
    enums)."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    return getattr(value, "value", str(value))


def _normalise_prompts(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int]]:
    return _prompts_and_salts(prompts)[0]


def _prompts_and_salts(
    prompts: PromptType | Sequence[PromptType],
) -> tuple[list[str | list[int]], list[str | None]]:
    """The prompts as text or token ids, and each one's ``cache_salt`` (vLLM's prompt-dict
    key: its prefix-cache pages are shared only with prompts of the same salt)."""
    salts: list[str | None] = []
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        prompts = [list(prompts)]  # one prompt given as token ids
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        salts.append(None)
        if isinstance(p, dict):
            salt = p.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise InvalidRequestError(
                    f"invalid parameter `cache_salt`: prompt {i}'s must be a non-empty string",
                    param="cache_salt",
                )
            salts[-1] = salt
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
    return out, salts


class _EngineClient:
    """What LLM and AsyncLLM share: the engine (one constructor), its tokenizer, output
        conversion. ``model=None`` uses the built-in default model (shipped in the package, no
        download); the keyword arguments are the engine settings of
        ``detspec.engine_args.ENGINE_SETTINGS``:

    {settings}
    """

    _engine: Any

    def __init__(self, model: str | os.PathLike[str] | None = None, **settings: Any) -> None:
        settings = resolve_engine_settings(settings)
        if model is None:
            from detspec.default_model import default_model_dir

            model = default_model_dir()
        self.model = os.fspath(model)
        self.enable_lora = bool(settings["enable_lora"])
        self._engine = _core.Engine(self.model, **settings)
        self.tokenizer = Tokenizer(self._engine) if self._engine.has_tokenizer() else None
        self._next_id = 0
        self._setup()

    def _setup(self) -> None:
        """Per-client state after the engine exists (AsyncLLM's dispatcher)."""

    def _new_request_id(self) -> str:
        rid = str(self._next_id)
        self._next_id += 1
        return rid

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    @property
    def fingerprint(self) -> str:
        """Identifies model weights, dtype, device kind and kernel version."""
        return self._engine.fingerprint()

    def kv_pages(self) -> tuple[int, int]:
        """``(free, total)`` KV-cache pages."""
        return self._engine.kv_pages()

    def kv_stats(self) -> dict[str, float]:
        """KV pool and prefix cache: total/free/used/cached/evictable pages, prefix queries,
        hits and hit rate; for models with linear-attention layers, the recurrent states
        running sequences may hold at once (``state_slots``, 0 for other models) and hold
        now (``states_held``)."""
        return self._engine.kv_stats()

    def stats(self) -> dict[str, Any]:
        """Engine-wide counters: verify passes, rollbacks, rolled-back tokens, padded verify
        rows, preemptions; steps run and their time by phase in seconds (``time_forward_s``:
        building and issuing forwards, on a GPU the host's share; ``time_sample_s``: waiting
        for the logits, copying them and sampling; ``time_verify_s``: verify passes)."""
        return self._engine.stats()

    def _decode_token(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _to_output(self, d: dict[str, Any], params: SamplingParams) -> RequestOutput:
        out = request_output_from_dict(d, params.logprobs, self._decode_token)
        out.sampling_params = params
        return out

    @property
    def eos_token_ids(self) -> list[int]:
        """The token ids that end a generation (config, generation config, tokenizer)."""
        return [int(t) for t in self._engine.eos_token_ids()]

    @property
    def weight_version(self) -> int:
        """How many weight updates have been applied since the model was loaded."""
        return self._engine.weight_version()

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, in tokens."""
        return int(self._engine.max_model_len())

    @property
    def max_logprobs(self) -> int:
        """The most top logprobs a request may ask for (the ``max_logprobs`` setting; the
        vocabulary's size where that is -1)."""
        return int(self._engine.max_logprobs())

    @property
    def dtype(self) -> str:
        """The weights' dtype as resolved at load (``auto`` included): ``float32``,
        ``bfloat16`` or ``float16``."""
        return str(self._engine.dtype())

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's dtype as resolved at load."""
        return str(self._engine.kv_cache_dtype())

    @property
    def vocab_size(self) -> int:
        return int(self._engine.vocab_size())

    @property
    def determinism(self) -> str:
        """The engine's determinism mode: ``"dvr"``, ``"batch_invariant"`` or ``"off"``."""
        return str(self._engine.determinism())

    def validate_request(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_param: str = "prompt",
    ) -> None:
        """Checks a tokenized prompt and/or sampling parameters with the rules the engine
        applies when a request is submitted (the same rule, message and parameter name),
        without submitting anything. Raises ``InvalidRequestError`` whose ``param`` names the
        parameter at fault; ``prompt_param`` is the prompt's name there (``"prompt[1]"``,
        ``"messages"``)."""
        ids = None
        if prompt_token_ids is not None:
            ids = [int(t) for t in prompt_token_ids]
            if any(t < 0 for t in ids):
                raise InvalidRequestError(
                    f"invalid parameter `{prompt_param}`: token ids must be non-negative",
                    param=prompt_param,
                )
        params = sampling_params.to_dict() if sampling_params is not None else None
        self._engine.validate_request(ids, params, prompt_param)

    # The work behind the sync (LLM) and async (AsyncLLM) twins below; blocking calls that
    # release the GIL while the engine thread runs them between steps.

    def _token_ids(self, prompts: PromptType | Sequence[PromptType]) -> list[list[int]]:
        """Prompts as token ids (text encoded as ``generate`` encodes it)."""
        out = []
        for p in _normalise_prompts(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        f"text prompt given but {self.model} has no tokenizer.json; pass token ids"
                    )
                p = self.tokenizer.encode(p)
            out.append(p)
        return out

    def _completion_ids(self, completions: Sequence[str | Sequence[int]]) -> list[list[int]]:
        out = []
        for i, c in enumerate(completions):
            if isinstance(c, str):
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        f"text completion given but {self.model} has no tokenizer.json"
                    )
                out.append(self.tokenizer.encode(c, add_special_tokens=False))
            elif isinstance(c, Sequence) and all(isinstance(t, int | np.integer) for t in c):
                out.append([int(t) for t in c])
            else:
                raise InvalidRequestError(
                    f"invalid parameter `completions`: completion {i} must be a string or a "
                    f"list of token ids, got {type(c).__name__}",
                    param="completions",
                )
        return out

    def load_lora(
        self, name: str, path: str | os.PathLike[str], *, replace: bool = False
    ) -> dict[str, Any]:
        """Loads the PEFT LoRA adapter in ``path`` (``adapter_config.json``,
        ``adapter_model.safetensors``) as ``name`` for requests to name (the engine needs
        ``enable_lora=True``). A loaded name is refused unless ``replace``: then requests
        submitted after get the new adapter, those in flight keep theirs (an RL trainer's new
        adapter each step). Returns its ``path``, ``rank`` and ``content_hash`` (the hash its
        requests' fingerprints carry)."""
        return dict(self._engine.load_lora(name, os.fspath(path), replace))

    def load_lora_from_tensors(
        self,
        name: str,
        tensors: Mapping[str, Any] | bytes,
        config: Mapping[str, Any] | Any,
        *,
        replace: bool = False,
    ) -> dict[str, Any]:
        """``load_lora`` of an adapter held in memory, without a file between a trainer and
        the engine (an RL step's new LoRA weights): ``tensors`` by PEFT name (what
        ``peft.get_peft_model_state_dict(model)`` returns; torch tensors or numpy arrays), or
        the bytes of a safetensors file; ``config`` the adapter's config as a dict or a
        ``peft.LoraConfig``. The same adapter as ``save_pretrained`` then ``load_lora`` of its
        directory, bit for bit (its ``content_hash`` too)."""
        if not isinstance(tensors, bytes | bytearray):
            tensors = _safetensors_bytes(tensors)
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        text = json.dumps(dict(config), default=_json_default)
        return dict(self._engine.load_lora_from_bytes(name, text, bytes(tensors), replace))

    def unload_lora(self, name: str) -> None:
        """Unloads adapter ``name``; requests running with it finish with it."""
        self._engine.unload_lora(name)

    def list_loras(self) -> dict[str, dict[str, Any]]:
        """``{name: {path, rank, content_hash}}`` of every loaded adapter."""
        return {k: dict(v) for k, v in self._engine.list_loras().items()}

    def _lora_name(self, lora: LoRAType) -> str | None:
        """The loaded adapter name ``lora`` means, loading a ``LoRARequest``'s path the first
        time its name is used (as vLLM does)."""
        if lora is None or isinstance(lora, str):
            return lora
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(
                "invalid parameter `lora_request`: expected a LoRARequest or an adapter name, "
                f"got {type(lora).__name__}",
                param="lora_request",
            )
        if lora.path and lora.lora_name not in self._engine.list_loras():
            try:
                self.load_lora(lora.lora_name, lora.path)
            except InvalidRequestError:
                # Loaded meanwhile by another caller: use it; anything else is this call's.
                if lora.lora_name not in self._engine.list_loras():
                    raise
        return lora.lora_name

    def _lora_names(self, lora: LoRAType | Sequence[LoRAType], n: int) -> list[str | None]:
        """One adapter name (or None) per request of ``n``: ``lora`` for all, or a list."""
        if lora is None or isinstance(lora, str | LoRARequest):
            return [self._lora_name(lora)] * n
        if not isinstance(lora, list | tuple):
            raise InvalidRequestError(
                "invalid parameter `lora_request`: expected a LoRARequest, an adapter name or a "
                f"list of them, got {type(lora).__name__}",
                param="lora_request",
            )
        loras = list(lora)
        if len(loras) != n:
            raise InvalidRequestError(
                f"invalid parameter `lora_request`: got {len(loras)} for {n} prompts",
                param="lora_request",
            )
        return [self._lora_name(x) for x in loras]

    def lora_fingerprint(self, lora: LoRAType = None) -> str:
        """The fingerprint of requests run with ``lora`` (the engine's, for ``None``)."""
        return str(self._engine.fingerprint(self._lora_name(lora)))

    def _score(
        self,
        prompts: PromptType | Sequence[PromptType],
        completions: Sequence[str | Sequence[int]],
        deterministic: bool,
        lora: LoRAType = None,
        cache_salt: str | None = None,
    ) -> list[list[float]]:
        ids = self._token_ids(prompts)
        comp = self._completion_ids(completions)
        if len(ids) != len(comp):
            raise InvalidRequestError(
                f"invalid parameter `completions`: got {len(comp)} for {len(ids)} prompts",
                param="completions",
            )
        pairs = list(zip(ids, comp, strict=True))
        scored = self._engine.score(pairs, 0, deterministic, self._lora_name(lora), cache_salt)
        return [[lp for _, lp, _, _ in s] for s in scored]

    @property
    def labels(self) -> list[str] | None:
        """A sequence classifier's label names (``id2label``, in id order); ``None`` for a
        language model."""
        labels = self._engine.labels()
        return None if labels is None else list(labels)

    def _classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        deterministic: bool,
        lora: LoRAType | Sequence[LoRAType],
    ) -> list[ClassificationRequestOutput]:
        ids = self._token_ids(prompts)
        names = self._lora_names(lora, len(ids))
        labels = self._engine.labels() or []
        found: list[tuple[list[float], list[float]]] = [([], [])] * len(ids)
        fingerprints = [""] * len(ids)
        # One engine call per adapter, as `_embed`.
        for name in dict.fromkeys(names):
            group = [i for i, n in enumerate(names) if n == name]
            rows = self._engine.classify([ids[i] for i in group], deterministic, name)
            fp = str(self._engine.fingerprint(name))
            for i, row in zip(group, rows, strict=True):
                found[i], fingerprints[i] = (list(row[0]), list(row[1])), fp
        out = []
        for p, (logits, probs), fp in zip(ids, found, fingerprints, strict=True):
            best = max(range(len(probs)), key=lambda k: (probs[k], -k)) if probs else 0
            label = labels[best] if best < len(labels) else str(best)
            out.append(
                ClassificationRequestOutput(
                    request_id=self._new_request_id(),
                    prompt_token_ids=p,
                    outputs=ClassificationOutput(probs=probs, logits=logits, label=label),
                    fingerprint=fp,
                )
            )
        return out

    def _embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling: str,
        dimensions: int | None,
        normalize: bool,
        deterministic: bool,
        lora: LoRAType | Sequence[LoRAType],
    ) -> list[EmbeddingRequestOutput]:
        ids = self._token_ids(prompts)
        names = self._lora_names(lora, len(ids))
        rows: list[list[float]] = [[] for _ in ids]
        fingerprints = [""] * len(ids)
        # One engine call per adapter: an embedding depends on its own sequence alone (or,
        # not deterministic, on the call's other sequences, as vLLM's batch would).
        for name in dict.fromkeys(names):
            group = [i for i, n in enumerate(names) if n == name]
            found = self._engine.embed(
                [ids[i] for i in group], pooling, dimensions, normalize, deterministic, name
            )
            fp = str(self._engine.fingerprint(name))
            for i, row in zip(group, np.from_dlpack(found).tolist(), strict=True):
                rows[i], fingerprints[i] = row, fp
        return [
            EmbeddingRequestOutput(
                request_id=self._new_request_id(),
                prompt_token_ids=p,
                outputs=EmbeddingOutput(row),
                fingerprint=fp,
            )
            for p, row, fp in zip(ids, rows, fingerprints, strict=True)
        ]

    def _prompt_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        k: int,
        deterministic: bool,
        lora: LoRAType = None,
        cache_salt: str | None = None,
    ) -> list[list[dict[int, Any] | None]]:
        ids = [[int(t) for t in p] for p in prompts]
        name = self._lora_name(lora)
        if deterministic:
            raws = self._engine.prompt_logprobs(ids, k, name, cache_salt)
        else:
            pairs = [(p[:1], p[1:]) for p in ids]
            raws = self._engine.score(pairs, k, False, name, cache_salt)
        return [prompt_logprobs_to_py(raw, self._decode_token) for raw in raws]

    def _update_weights(self, named_tensors: Any, in_flight: str) -> None:
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        self._engine.update_weights(list(items), in_flight)

    def _audit(
        self,
        output: RequestOutput,
        sampling_params: SamplingParams | None,
        lora: LoRAType = None,
    ) -> AuditReport:
        name = self._lora_name(lora)
        expected = str(self._engine.fingerprint(name))
        if output.fingerprint != expected:
            raise InvalidRequestError(
                f"invalid parameter `output`: it was generated under fingerprint "
                f"{output.fingerprint}, this engine's is {expected}; an audit can only "
                "re-run an output on the engine build, weights and LoRA adapter that produced "
                "it (pass the adapter as `lora_request`)",
                param="output",
            )
        params = params_for_audit(output, sampling_params)
        if not params.deterministic:
            raise InvalidRequestError(
                "invalid parameter `output`: only deterministic outputs can be audited (a "
                "non-deterministic one depends on what ran beside it)",
                param="output",
            )
        items = [
            (list(output.prompt_token_ids), params.to_dict(), c.index, list(c.token_ids))
            for c in output.outputs
        ]
        return compare(output, self._engine.audit(items, name))

    def _prompt_logprobs_first(
        self,
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
        loras: Sequence[str | None],
        salts: Sequence[str | None],
    ) -> list[list[dict[int, Any] | None] | None]:
        """Each request's ``prompt_logprobs`` (``None`` where not asked for), computed before
        its generation is submitted: their forward leaves the prompt's KV pages in the prefix
        cache, so the generation does not compute the prompt again (vLLM computes them in the
        prefill). One engine call per distinct k; a request is first checked as submitting it
        would check it, so a bad one fails with the same error."""
        out: list[list[dict[int, Any] | None] | None] = [None] * len(prompts)
        by_k: dict[tuple[int, str | None, str | None], list[tuple[int, list[int]]]] = {}
        for i, (p, sp, lora, salt) in enumerate(zip(prompts, params, loras, salts, strict=True)):
            if sp.prompt_logprobs is not None:
                (ids,) = self._token_ids([p])
                self.validate_request(ids, sp)
                by_k.setdefault((sp.prompt_logprobs, lora, salt), []).append((i, ids))
        for (k, lora, salt), group in by_k.items():
            found = self._prompt_logprobs([ids for _, ids in group], k, True, lora, salt)
            for (i, _), plp in zip(group, found, strict=True):
                out[i] = plp
        return out

    def reset_prefix_cache(self) -> int:
        """Drops the prefix cache (pages of running requests stay theirs); returns how many
        cached pages it let go. Outputs do not change: cached KV equals recomputed KV."""
        return int(self._engine.reset_prefix_cache())

    def shutdown(self) -> None:
        """Stops the engine thread; unfinished requests end with finish_reason "abort"."""
        self._engine.shutdown()


_EngineClient.__doc__ = (_EngineClient.__doc__ or "").format(settings=engine_settings_doc())
# What `help(LLM)` and IDEs show: the settings as keyword-only parameters.
_EngineClient.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter(
            "model",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=None,
            annotation="str | os.PathLike[str] | None",
        ),
        *(
            inspect.Parameter(
                s.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=s.default,
                annotation=f"{s.type.__name__} | None" if s.optional else s.type.__name__,
            )
            for s in ENGINE_SETTINGS
        ),
    ]
)


class LLM(_EngineClient):
    """Loads a Hugging Face model directory and generates from it (offline, blocking).

    ``model=None`` uses the built-in default model (shipped in the package, no download).
    """

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAType | Sequence[LoRAType] = None,
    ) -> list[RequestOutput]:
        """Generates a completion for every prompt with continuous batching; returns outputs
        in prompt order. If any request fails, the others are aborted and the error raised.
        ``lora_request``: a ``LoRARequest`` (or loaded adapter name) for every prompt, or one
        per prompt."""
        plist, salts = _prompts_and_salts(prompts)
        params = _as_params_list(sampling_params, len(plist))
        loras = self._lora_names(lora_request, len(plist))
        prompt_logprobs = self._prompt_logprobs_first(plist, params, loras, salts)
        queue = _core.OutputQueue()
        ids: list[str] = []
        results: dict[str, dict[str, Any]] = {}
        try:
            for p, sp, lora, salt in zip(plist, params, loras, salts, strict=True):
                rid = self._new_request_id()
                self._engine.add_request(queue, rid, p, sp.to_dict(), False, lora, salt)
                ids.append(rid)
            with _progress(len(ids), use_tqdm) as bar:
                while len(results) < len(ids):
                    for rid, d, exc in queue.next_outputs(None):
                        if exc is not None:
                            raise exc
                        if d is not None and d["finished"]:
                            results[rid] = d
                            bar.done(d)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    self._engine.abort(rid)
            raise
        outs = [self._to_output(results[rid], sp) for rid, sp in zip(ids, params, strict=True)]
        for o, plp in zip(outs, prompt_logprobs, strict=True):
            o.prompt_logprobs = plp
        return outs

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRAType | Sequence[LoRAType] = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation (a list of ``{"role", "content"}`` messages) or to a
        batch of them, each rendered with the model's chat template (or ``chat_template``, a
        Jinja source), as vLLM's ``LLM.chat`` (``tools`` reach the template;
        ``continue_final_message`` continues the last message, with
        ``add_generation_prompt=False``). Each output's ``prompt`` is the rendered text."""
        if self.tokenizer is None:
            raise InvalidRequestError(f"chat needs a tokenizer: {self.model} has no tokenizer.json")
        if not messages:
            raise InvalidRequestError(
                "invalid parameter `messages`: no conversation given", param="messages"
            )
        single = isinstance(messages[0], Mapping)
        conversations = [messages] if single else list(messages)
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        texts = [
            str(
                self.tokenizer.apply_chat_template(
                    conv,
                    add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template,
                    **extra,
                )
            )
            for conv in conversations
        ]
        prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

    def compute_logits(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per-position logits ``[len_i, vocab]`` of each token-id prompt, as numpy arrays
        sharing the engine's buffers (see ``get_logits`` for torch tensors)."""
        rows = self._engine.prompt_logits([[int(t) for t in p] for p in prompts])
        return [np.from_dlpack(t) for t in rows]

    def get_logits(self, prompts: PromptType | Sequence[PromptType]) -> list[torch.Tensor]:
        """Per-position logits of each prompt as a float32 torch tensor ``[len, vocab]``
        (no copy: the tensor shares the engine's buffer). Computed on the verify-path kernels,
        so they are the logits a deterministic request computes for the same tokens."""
        from detspec.torch import to_torch

        return [to_torch(a) for a in self._engine.prompt_logits(self._token_ids(prompts))]

    def encode(
        self, prompts: PromptType | Sequence[PromptType], output: str = "hidden_states"
    ) -> list[torch.Tensor]:
        """The last layer's hidden states (after the final norm: transformers'
        ``last_hidden_state``) of each prompt, a float32 torch tensor ``[len, hidden]``."""
        if output != "hidden_states":
            raise InvalidRequestError(
                f'invalid parameter `output`: only "hidden_states" is supported, got {output!r}',
                param="output",
            )
        from detspec.torch import to_torch

        return [to_torch(a) for a in self._engine.hidden_states(self._token_ids(prompts))]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling: str = "last",
        dimensions: int | None = None,
        normalize: bool = True,
        deterministic: bool = True,
        lora_request: LoRAType | Sequence[LoRAType] = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, as vLLM's ``LLM.embed`` of a decoder embedding model
        (Qwen3-Embedding, e5-mistral, gte-Qwen): the last layer's hidden state after the final
        norm at the last position (``pooling="mean"``: averaged over the positions), its first
        ``dimensions`` values (Matryoshka), L2-normalised. The pooling and the norm run in a
        fixed order in the engine, so with ``deterministic=True`` (the verify-path kernels)
        an embedding is the same bits whatever else runs, on every instruction set; ``False``:
        the fast path, whose bits depend on the prompts embedded together."""
        return self._embed(prompts, pooling, dimensions, normalize, deterministic, lora_request)

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        deterministic: bool = True,
        lora_request: LoRAType | Sequence[LoRAType] = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities, as vLLM's ``LLM.classify`` of a sequence
        classifier (a ``*ForSequenceClassification`` checkpoint: reward models, classifiers):
        the ``score`` layer at the last token, softmax over the labels (the logistic function
        of a single label). With ``deterministic=True`` (the verify-path kernels) the logits
        are the same bits whatever else runs, and the probabilities a fixed-order function of
        them, on every instruction set. ``labels`` names the classes."""
        return self._classify(prompts, deterministic, lora_request)

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        deterministic: bool = True,
        lora_request: LoRAType | Sequence[LoRAType] = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's reward, as vLLM's ``LLM.reward`` of a reward model (a
        ``*ForSequenceClassification`` checkpoint, usually one label): the ``score`` layer's raw
        output at the last token, no activation. ``deterministic`` as in ``classify``."""
        return _rewards(self._classify(prompts, deterministic, lora_request))

    def score(
        self,
        prompts: PromptType | Sequence[PromptType],
        completions: Sequence[str | Sequence[int]],
        deterministic: bool = True,
        *,
        lora_request: LoRAType = None,
        cache_salt: str | None = None,
    ) -> list[list[float]]:
        """The logprob of each completion token given its prompt (raw logits, as the sampler
        reports them), one list per (prompt, completion) pair. ``deterministic=True`` computes
        them on the verify-path kernels: a deterministic request's generated completion scores
        to exactly the logprobs it was generated with, bit for bit (with its
        ``lora_request``). ``cache_salt``: the prompts' prefix-cache pages are read from and
        left among those of this salt only (as a generation's prompt dict's ``cache_salt``)."""
        return self._score(prompts, completions, deterministic, lora_request, cache_salt)

    def update_weights(self, named_tensors: Any, *, in_flight: str = "finish") -> None:
        """Replaces weights by Hugging Face parameter name, e.g.
        ``llm.update_weights(model.state_dict().items())``; a subset updates only those.
        Tensors are float32/bfloat16/float16 (converted to the engine's dtype). Every name,
        shape and dtype is checked first; on any error nothing changes. ``in_flight="finish"``
        lets running requests finish on the old weights (requests submitted meanwhile wait for
        the new ones); ``"abort"`` aborts them. The prefix cache is dropped, ``weight_version``
        bumped, and ``fingerprint`` moves to the new weights (restoring the old weights
        restores the old fingerprint)."""
        self._update_weights(named_tensors, in_flight)

    def update_weights_from_disk(
        self, path: str | os.PathLike[str], *, in_flight: str = "finish", complete: bool = False
    ) -> None:
        """``update_weights`` from a safetensors checkpoint directory (every parameter of this
        model it holds). ``complete=True`` refuses a checkpoint that lacks any parameter (a
        tied model's ``lm_head.weight`` excepted), naming it, before anything changes."""
        self._engine.update_weights_from_checkpoint(os.fspath(path), in_flight, complete)

    def update_weights_from_safetensors(self, data: bytes, *, in_flight: str = "finish") -> None:
        """``update_weights`` from a serialized safetensors buffer (the bytes of a
        ``.safetensors`` file: ``safetensors.torch.save(state_dict)``), by HF name."""
        self._engine.update_weights_from_safetensors(data, in_flight)

    def prompt_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        k: int = 0,
        *,
        deterministic: bool = True,
        lora_request: LoRAType = None,
        cache_salt: str | None = None,
    ) -> list[list[dict[int, Any] | None]]:
        """vLLM's ``prompt_logprobs`` of token-id prompts, as ``SamplingParams(prompt_logprobs=k)``
        returns them: ``None`` for the first token, then ``{token: Logprob}`` with the prompt
        token and the top ``k``. ``deterministic=True`` (verify-path kernels): bit for bit
        ``generate``'s prompt logprobs, computed as a deterministic prefill computes the prompt
        (on invariant kernels, as on the CPU by default, also ``score(p[:1], p[1:])``'s
        values); the prompt's KV pages stay in the prefix cache for its generation. ``False``:
        the fast path, whose bits depend on the prompts computed together in this call.
        ``cache_salt``: as ``score``'s."""
        return self._prompt_logprobs(prompts, k, deterministic, lora_request, cache_salt)

    def audit(
        self,
        output: RequestOutput,
        sampling_params: SamplingParams | None = None,
        *,
        lora_request: LoRAType = None,
    ) -> AuditReport:
        """Re-runs a stored output (prompt, parameters, seed, token ids) under this engine and
        reports whether every token id and logprob matches bit for bit, and the first
        position that differs if not. Refuses an output whose fingerprint is not this
        engine's. ``sampling_params`` defaults to the ones recorded on the output; an output
        generated with an adapter is audited with it (``lora_request``)."""
        return self._audit(output, sampling_params, lora_request)


def _rewards(classified: list[ClassificationRequestOutput]) -> list[PoolingRequestOutput]:
    """``LLM.reward``'s outputs: each classification's raw logits."""
    return [
        PoolingRequestOutput(
            request_id=c.request_id,
            prompt_token_ids=c.prompt_token_ids,
            outputs=PoolingOutput(c.outputs.logits),
            fingerprint=c.fingerprint,
        )
        for c in classified
    ]


class _progress:
    """vLLM-style progress bar: processed prompts and input/output token throughput."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self._in = 0
        self._out = 0

    def __enter__(self) -> _progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()

    def done(self, d: dict[str, Any]) -> None:
        if self._bar is None:
            return
        self._in += len(d["prompt_token_ids"])
        self._out += sum(len(c["token_ids"]) for c in d["outputs"])
        elapsed = self._bar.format_dict.get("elapsed") or 1e-9
        self._bar.set_postfix_str(
            f"est. speed input: {self._in / elapsed:.2f} toks/s, "
            f"output: {self._out / elapsed:.2f} toks/s",
            refresh=False,
        )
        self._bar.update(1)
