"""The request handling behind the OpenAI routes: admission, validation (the engine's rules,
through ``AsyncLLM.validate_request``), sampling parameters, generation and the non-streamed
response bodies (``protocol``'s response models). A request's jobs are in ``jobs``, the
fields every body shares in ``shaping``, streaming in ``streaming``, logprob shapes in
``logprobs``, chat rendering in ``chat``, constraints and ``logit_bias`` in ``structured``,
tool calls in ``tools`` (and ``tool_parsers``), a thinking model's reasoning in
``reasoning``. ``echo`` (``scoring_routes``) builds on this module, not this one on it."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from detspec.async_llm import AsyncLLM
from detspec.errors import DetspecError, InvalidRequestError
from detspec.outputs import RequestOutput
from detspec.sampling_params import SamplingParams
from detspec.server import protocol as P
from detspec.server.chat import conversation, render_chat
from detspec.server.defaults import DEFAULT_SEED, RequestDefaults
from detspec.server.errors import RETRY_AFTER, ApiError, engine_error, invalid
from detspec.server.harmony import START as HARMONY_START
from detspec.server.harmony import HarmonyFormat
from detspec.server.jobs import Job, completion_prompts, keeps_special_tokens
from detspec.server.logprobs import LogprobShaper
from detspec.server.metrics import ServerMetrics
from detspec.server.reasoning import (
    ReasoningParser,
    ReasoningPlan,
    generation_prompt,
    reasoning_parser,
)
from detspec.server.score_batcher import ScoreBatcher
from detspec.server.shaping import choice_fields, dvr_metrics, usage
from detspec.server.streaming import ClientGone, first_output, merge, sse_body, until_disconnect
from detspec.server.structured import (
    Constraint,
    constraint_invalid,
    logit_bias,
    request_constraints,
    single,
)
from detspec.server.tool_parsers import PARSERS
from detspec.server.tools import ToolPlan, check_tools, harmony_calls, plan_tools


@dataclass(frozen=True)
class CorsSettings:
    """What browsers on other origins may do (Starlette's ``CORSMiddleware`` arguments)."""

    allow_origins: list[str]
    allow_methods: list[str] = field(default_factory=lambda: ["*"])
    allow_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass
class ServerConfig:
    """Server settings (engine settings go to ``AsyncLLM``)."""

    served_model_names: list[str] = field(default_factory=lambda: ["detspec"])
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_request_bytes: int = 16 * 1024 * 1024
    max_num_seqs: int = 256
    # The engine's determinism mode; None: the engine's (AsyncLLM.determinism).
    determinism: str | None = None
    # Requests that do not say `deterministic` are deterministic; sampled ones without a
    # seed get default_seed (server/defaults.py).
    deterministic_by_default: bool = False
    default_seed: int = DEFAULT_SEED
    # Tool calls of tool_choice "auto" are read from the output by this parser (vLLM's
    # --tool-call-parser); "auto" needs both (--enable-auto-tool-choice).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # A thinking model's format (vLLM's --reasoning-parser): chat answers split into
    # reasoning and content, output constraints applied after the thinking.
    reasoning_parser: str | None = None
    # Request defaults from the generation config (server/generation_config.py), keyed by
    # request field.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # The fingerprint suffix naming the settings that change what a request means
    # (RequestDefaults.settings_suffix).
    settings_suffix: str = ""
    # vLLM's --chat-template (the source, read at start-up) replaces the model's; a
    # request's `chat_template` is honoured only with --trust-request-chat-template.
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    # Cross-origin requests (vLLM's --allowed-origins, ...): None, no CORS headers at all.
    cors: CorsSettings | None = None
    # vLLM's --enable-request-id-headers: X-Request-Id on every response.
    request_id_headers: bool = False
    # Responses API responses kept for previous_response_id (responses_store); 0: none.
    max_stored_responses: int = 1024


def response_ids(prefix: str, request_id: str | None) -> tuple[str, str]:
    """A response's id (``prefix`` + the client's ``request_id``, as vLLM) and the base of its
    engine requests' ids, which stay unique when a client reuses its id."""
    rid = f"{prefix}{uuid.uuid4().hex}"
    return (rid if request_id is None else f"{prefix}{request_id}"), rid


class OpenAIServer:
    """Request handling shared by the routes."""

    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_names = list(config.served_model_names)
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.defaults = RequestDefaults(
            config.deterministic_by_default,
            config.default_seed,
            dict(config.sampling_defaults),
            config.settings_suffix,
        )
        if config.tool_call_parser is not None and config.tool_call_parser not in PARSERS:
            raise ValueError(
                f"unknown tool-call parser {config.tool_call_parser!r} (known: "
                f"{', '.join(sorted(PARSERS))})"
            )
        if config.enable_auto_tool_choice and config.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.tool_parser = config.tool_call_parser if config.enable_auto_tool_choice else None
        self.reasoning_parser = (
            reasoning_parser(config.reasoning_parser, self.tokenizer)
            if config.reasoning_parser is not None
            else None
        )
        harmony = isinstance(self.reasoning_parser, HarmonyFormat)
        if self.tool_parser is not None and harmony != PARSERS[self.tool_parser].harmony:
            raise ValueError(
                "gpt-oss's tool calls are Harmony messages: --tool-call-parser openai goes "
                "with --reasoning-parser openai_gptoss, and that reasoning parser with no "
                f"other tool-call parser (got {self.tool_parser} and {config.reasoning_parser})"
            )
        self.determinism = config.determinism or engine.determinism
        if self.defaults.deterministic_by_default and self.determinism == "off":
            raise ValueError(
                "--deterministic-by-default needs a deterministic engine: start it with "
                "--determinism dvr or batch_invariant"
            )
        self.score_batcher = ScoreBatcher(engine)
        # The label the last weight update gave its weights (SGLang's ``weight_version``).
        self.weight_version_label: str | None = None
        self.created = int(time.time())
        self.inflight_seqs = 0
        self.draining = False
        self._decode_cache: dict[int, str] = {}
        self.logprobs = LogprobShaper(self.decode_token)
        self.metrics = ServerMetrics(
            self.model_names[0], self.queue_counts, engine.kv_stats, engine.stats
        )

    def check_logprobs(self, **asked: int | None) -> None:
        """Each count of top logprobs a request asks for, by its field's name, against the
        engine's ``max_logprobs`` (``--max-logprobs``): a 400 naming the field."""
        limit = self.engine.max_logprobs
        for name, n in asked.items():
            if n is not None and n > limit:
                raise ApiError(
                    400,
                    f"{name}={n} asks for more top logprobs than this server's max_logprobs "
                    f"({limit}); start it with a larger --max-logprobs (-1: the vocabulary)",
                    name,
                )

    @property
    def fingerprint(self) -> str:
        """The engine's current fingerprint (it moves when the weights are updated), with
        ``+det-default-seed<N>`` under --deterministic-by-default."""
        return self.engine.fingerprint + self.defaults.fingerprint_suffix()

    def fingerprint_of(self, job: Job) -> str:
        """The fingerprint of ``job``'s answer: the one the engine gave the request (the
        weights it ran on, its LoRA adapter's), else that of its adapter now; with the
        server's suffix."""
        fp = job.fingerprint or self.engine.lora_fingerprint(job.lora)
        return fp + self.defaults.fingerprint_suffix()

    def weight_version_name(self) -> str:
        """The weights' version as SGLang reports it: the last update's label, else the
        number of updates."""
        label = self.weight_version_label
        return label if label is not None else str(self.engine.weight_version)

    # ---------------------------------------------------------------- bookkeeping

    def queue_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences: the engine runs at most ``max_num_seqs`` at once;
        the rest of what the server has submitted waits."""
        running = min(self.inflight_seqs, self.config.max_num_seqs)
        return running, self.inflight_seqs - running

    def _admit(self, nseqs: int) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", None, headers=RETRY_AFTER)
        limit = self.config.max_waiting_requests
        if limit is not None:
            waiting = max(0, self.inflight_seqs + nseqs - self.config.max_num_seqs)
            if waiting > limit:
                raise ApiError(
                    503,
                    f"the waiting queue is full: {waiting} sequences would wait, over the "
                    f"limit of {limit} (--max-waiting-requests); retry later",
                    None,
                    headers=RETRY_AFTER,
                )
        self.inflight_seqs += nseqs

    def check_model(self, name: str | None) -> str:
        """The model a request names: a served name of the base model, or a loaded LoRA
        adapter's (as vLLM serves them)."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names and self.lora_of(name) is None:
            served = [*self.model_names, *self.engine.list_loras()]
            raise ApiError(
                404,
                f"The model `{name}` does not exist (served: {', '.join(served)}).",
                "model",
            )
        return name

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model)."""
        if model is None or model in self.model_names or not self.engine.enable_lora:
            return None
        return model if model in self.engine.list_loras() else None

    def decode_token(self, t: int) -> str:
        s = self._decode_cache.get(t)
        if s is None:
            s = self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer else ""
            if len(self._decode_cache) < 1_000_000:
                self._decode_cache[t] = s
        return s

    # ---------------------------------------------------------------- validation

    def common_checks(self, req: P._SamplingFields) -> None:
        """What only the HTTP surface has (OpenAI fields the engine does not implement);
        everything the engine decides is checked by ``validate``."""
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, "best_of other than n is not supported", "best_of")
        if req.stream_options is not None and not req.stream:
            raise ApiError(
                400, "stream_options can only be given when stream=true", "stream_options"
            )

    def validate(
        self,
        ids: list[int] | None = None,
        params: SamplingParams | None = None,
        param: str = "prompt",
        job: Job | None = None,
    ) -> None:
        """The engine's request rules (``AsyncLLM.validate_request``), as a 400."""
        try:
            self.engine.validate_request(ids, params, prompt_param=param)
        except InvalidRequestError as e:
            raise constraint_invalid(e, job.constraint if job else None, param) from None

    def max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """OpenAI's rule: an absent ``max_tokens`` fills the context (up to the generation
        config's cap), one that does not fit is refused."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return self.defaults.max_tokens(room)
        if requested > room:
            raise ApiError(
                400,
                f"{param}={requested} plus the prompt's {prompt_len} tokens is over this "
                f"model's maximum context length (max_model_len={self.max_model_len})",
                param,
            )
        return requested

    def sampling_params(
        self,
        req: P._SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        constraint: Constraint | None = None,
        keep_special_tokens: bool = False,
    ) -> SamplingParams:
        """The engine's parameters of ``req``, with its output constraint;
        ``keep_special_tokens``: a parser reads markers that are special tokens (as vLLM)."""
        extra: dict[str, Any] = {}
        bias = logit_bias(req.logit_bias)
        if bias is not None:
            extra["logit_bias"] = bias
        skip_special = req.skip_special_tokens and not keep_special_tokens
        try:
            if constraint is not None:
                extra["structured_outputs"] = constraint.engine_params()
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                include_stop_str_in_output=req.include_stop_str_in_output,
                stop_token_ids=req.stop_token_ids,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if req.repetition_penalty is None else req.repetition_penalty
                ),
                deterministic=bool(req.deterministic),
                skip_special_tokens=skip_special,
                **extra,
            )
        except InvalidRequestError as e:
            raise constraint_invalid(e, constraint) from None

    def job(
        self,
        req: P._SamplingFields,
        index: int,
        rid: str,
        ids: list[int],
        param: str,
        max_tokens: int | None,
        max_tokens_param: str,
        logprobs: int | None,
        constraint: Constraint | None = None,
        tools: ToolPlan | None = None,
        reasoning: ReasoningPlan | None = None,
    ) -> Job:
        """One engine request, validated: the prompt (its last ``truncate_prompt_tokens``),
        then ``max_tokens`` against the context, then the sampling parameters."""
        last = req.truncate_prompt_tokens
        if last is not None:
            last = self.max_model_len if last == -1 else last
            ids = ids[len(ids) - last :] if last < len(ids) else ids
        self.validate(ids, None, param)
        n = self.max_tokens(max_tokens, len(ids), max_tokens_param)
        keep = keeps_special_tokens(tools, reasoning)
        params = self.sampling_params(req, n, logprobs, constraint, keep)
        job = Job(
            index,
            rid,
            ids,
            params,
            constraint=constraint,
            tools=tools,
            reasoning=reasoning,
            lora=self.lora_of(req.model),
            cache_salt=req.cache_salt,
        )
        self.validate(None, params, param, job)
        return job

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(
                400, "this model has no tokenizer: send the prompt as token ids", "prompt"
            )
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        except InvalidRequestError as e:
            raise invalid(e, "prompt") from None

    async def encode_pair(self, text: str, text_pair: str, add_special_tokens: bool) -> list[int]:
        """A cross-encoder's input: the two texts joined by the tokenizer's pair template."""
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", "text_1")
        try:
            return await asyncio.to_thread(
                self.tokenizer.encode_pair, text, text_pair, add_special_tokens
            )
        except InvalidRequestError as e:
            raise invalid(e, "text_1") from None

    async def render_chat(
        self,
        messages: list[P.ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The conversation's token ids, rendered with ``chat_template`` (a request's), else
        the server's ``--chat-template``, else the model's."""
        if chat_template is not None and not self.config.trust_request_chat_template:
            raise ApiError(
                400,
                "a request's chat_template needs a server started with "
                "--trust-request-chat-template",
                "chat_template",
            )
        return await render_chat(
            self.tokenizer,
            messages,
            add_generation_prompt,
            template_kwargs,
            tools,
            continue_final_message,
            chat_template if chat_template is not None else self.config.chat_template,
            add_special_tokens,
        )

    async def prompt_logprobs(
        self, ids: list[int], k: int, lora: str | None = None, cache_salt: str | None = None
    ) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` as JSON: the engine's numbers, bit for bit those of
        ``LLM.generate`` (verify-path kernels; with the LoRA adapter ``lora``; the prompt's
        pages cached under ``cache_salt``). Through the score batcher, so concurrent calls (a
        request's prompts, other requests) share one engine call."""
        entries = await self.score_batcher.prompt_logprobs(ids, k, True, lora, cache_salt)
        return LogprobShaper.prompt(entries)

    async def attach_prompt_logprobs(self, jobs: list[Job], k: int | None) -> None:
        """Each job's ``prompt_logprobs`` (vLLM's field), all asked for at once."""
        if k is None:
            return
        found = await asyncio.gather(
            *(self.prompt_logprobs(j.prompt_ids, k, j.lora, j.cache_salt) for j in jobs)
        )
        for j, plp in zip(jobs, found, strict=True):
            j.prompt_logprobs = plp

    # ---------------------------------------------------------------- generation

    async def _stream_job(self, job: Job, delta: bool) -> AsyncIterator[RequestOutput]:
        """One engine request, with its metrics."""
        m = self.metrics
        start = time.perf_counter()
        last = start
        first = True
        ntok = 0
        m.prompt_tokens.inc(len(job.prompt_ids))
        m.prompt_len.observe(len(job.prompt_ids))
        if job.params.deterministic:
            m.deterministic_requests.inc()
        out: RequestOutput | None = None
        prompt: Any = job.prompt_ids
        if job.cache_salt is not None:
            prompt = {"prompt_token_ids": job.prompt_ids, "cache_salt": job.cache_salt}
        stream = self.engine.generate(
            prompt, job.params, request_id=job.rid, delta=delta, lora_request=job.lora
        )
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    job.fingerprint = out.fingerprint
                    now = time.perf_counter()
                    count = sum(len(c.token_ids) for c in out.outputs)
                    new = count if delta else count - ntok
                    if new > 0:
                        if first:
                            m.ttft.observe(now - start)
                            first = False
                        else:
                            for _ in range(new):
                                m.itl.observe((now - last) / new)
                        m.generation_tokens.inc(new)
                        ntok += new
                        last = now
                    yield out
        finally:
            if out is not None and out.finished:
                m.e2e.observe(time.perf_counter() - start)
                m.gen_len.observe(ntok)
                for c in out.outputs:
                    m.request_finished(c.finish_reason)
                if job.params.deterministic:
                    m.verify_passes_per_request.observe(out.metrics.get("num_verify_passes", 0))
            else:  # the client left, or the engine failed or stopped: aborted
                for _ in range(job.params.n):
                    m.request_finished("abort")

    async def run(
        self, jobs: list[Job], delta: bool = False
    ) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """The outputs of ``jobs`` as they come (cumulative, or deltas), admitted against the
        waiting-queue limit. Closing it aborts every unfinished engine request."""
        nseqs = sum(j.params.n for j in jobs)
        self._admit(nseqs)
        try:
            merged = merge([(j, self._stream_job(j, delta)) for j in jobs])
            async with contextlib.aclosing(merged):
                async for item in merged:
                    yield item
        finally:
            self.inflight_seqs -= nseqs

    async def last_outputs(self, jobs: list[Job]) -> dict[int, RequestOutput]:
        """Runs ``jobs`` to the end; the last output of each, by ``Job.index``."""
        last: dict[int, RequestOutput] = {}
        if not jobs:
            return last
        agen = self.run(jobs)
        try:
            async for job, out in agen:
                last[job.index] = out
        finally:
            await agen.aclose()  # type: ignore[attr-defined]
        return last

    # ---------------------------------------------------------------- completions

    async def completions(self, req: P.CompletionRequest, request: Request) -> Response:
        """``/v1/completions`` without ``echo`` (``app`` sends those to ``scoring_routes``)."""
        self.defaults.apply(req)
        check_max_tokens(req)
        model = self.check_model(req.model)
        self.common_checks(req)
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported", "suffix")
        constraint = single(request_constraints(req))
        prompts = completion_prompts(req.prompt)
        base, rid = response_ids("cmpl-", req.request_id)
        jobs: list[Job] = []
        for i, pr in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            ids = await self.encode(pr, req.add_special_tokens) if isinstance(pr, str) else list(pr)
            jobs.append(
                self.job(
                    req,
                    i,
                    f"{rid}-{i}",
                    ids,
                    param,
                    req.max_tokens,
                    "max_tokens",
                    req.logprobs,
                    constraint,
                )
            )
        await self.attach_prompt_logprobs(jobs, req.prompt_logprobs)
        return await self.respond(req, request, jobs, base, model, chat=False)

    # ---------------------------------------------------------------- chat

    async def chat(self, req: P.ChatCompletionRequest, request: Request) -> Response:
        job, base, model = await self.chat_job(req, "chatcmpl-")
        return await self.respond(req, request, [job], base, model, chat=True)

    async def chat_job(self, req: P.ChatCompletionRequest, prefix: str) -> tuple[Job, str, str]:
        """A chat request's engine request, checked and rendered: (the job, the response id,
        which starts with ``prefix``, the model name). ``/v1/responses`` runs on it too."""
        self.defaults.apply(req)
        # Template variables sent as fields (unless also sent as chat_template_kwargs).
        fields = {"reasoning_effort": req.reasoning_effort, "documents": req.documents}
        fields = {k: v for k, v in fields.items() if v is not None}
        if fields:
            req.chat_template_kwargs = {**fields, **(req.chat_template_kwargs or {})}
        model = self.check_model(req.model)
        self.common_checks(req)
        tools = plan_tools(req, self.tool_parser)
        if isinstance(self.reasoning_parser, HarmonyFormat) and tools.mode in ("required", "named"):
            assert req.tools is not None
            tools = harmony_calls(tools, req.tools)
        constraints = request_constraints(req)
        if tools.constraint is not None:  # the request's own one is the one too many
            constraints.insert(0, tools.constraint)
        constraint = single(constraints)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if req.max_completion_tokens is not None and req.max_tokens is not None:
            if req.max_completion_tokens != req.max_tokens:
                raise ApiError(
                    400,
                    "max_tokens and max_completion_tokens disagree; send one of them",
                    "max_completion_tokens",
                )
        ids = await self.render_chat(
            req.messages,
            req.add_generation_prompt,
            req.chat_template_kwargs,
            tools.tools,
            req.continue_final_message,
            req.chat_template,
            req.add_special_tokens,
        )
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = await self.reasoning_plan(self.reasoning_parser, req, ids, tools.tools)
            if reasoning.thinking and constraint is not None and not constraint.whole_output:
                constraint = constraint.after_tokens(reasoning.gate)
            if not req.separate_reasoning:
                reasoning = None
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        k = (req.top_logprobs or 0) if req.logprobs else None
        base, rid = response_ids(prefix, req.request_id)
        job = self.job(
            req,
            0,
            f"{rid}-0",
            ids,
            "messages",
            max_tokens,
            max_param,
            k,
            constraint,
            tools,
            reasoning,
        )
        if req.prompt_logprobs is not None:
            job.prompt_logprobs = await self.prompt_logprobs(
                job.prompt_ids, req.prompt_logprobs, job.lora, job.cache_salt
            )
        if req.echo and req.messages[-1].role == "assistant":
            job.echo = conversation(req.messages[-1:])[0]["content"] or ""
        return job, base, model

    async def reasoning_plan(
        self,
        parser: ReasoningParser | HarmonyFormat,
        req: P.ChatCompletionRequest,
        ids: list[int],
        tools: list[dict[str, Any]] | None,
    ) -> ReasoningPlan:
        """Whether the answer to ``ids`` (``req`` rendered) begins inside a thinking block:
        the generation prompt's tags decide, so the conversation is rendered once more
        without it (only when the prompt holds a tag at all). Harmony's reader starts from
        the prompt's last message, from its last ``<|start|>``."""
        if isinstance(parser, HarmonyFormat):
            return await self._harmony_plan(parser, req, ids)
        gen: list[int] = []
        tagged = parser.start_id in ids or parser.end_id in ids
        if req.continue_final_message and self.tokenizer is not None:
            # the answer goes on with the last message: its tags decide
            final = conversation(req.messages[-1:])[0]["content"]
            gen = await asyncio.to_thread(self.tokenizer.encode, final, False)
        elif req.add_generation_prompt and tagged:
            without = await self.render_chat(
                req.messages,
                False,
                req.chat_template_kwargs,
                tools,
                False,
                req.chat_template,
                req.add_special_tokens,
            )
            gen = list(generation_prompt(ids, without))
        thinking = parser.thinks(gen, req.chat_template_kwargs or {})
        return ReasoningPlan(parser, thinking, req.include_reasoning)

    async def _harmony_plan(
        self, fmt: HarmonyFormat, req: P.ChatCompletionRequest, ids: list[int]
    ) -> ReasoningPlan:
        starts = [i for i, t in enumerate(ids) if fmt.markers.get(t) == HARMONY_START]
        tail = tuple(ids[starts[-1] :]) if starts and self.tokenizer is not None else ()
        text = await asyncio.to_thread(self.tokenizer.decode, list(tail), False) if tail else ""
        primer = (text, tail)
        before_answer = not fmt.reader(False, primer).answering
        return ReasoningPlan(fmt, before_answer, req.include_reasoning, primer)

    # ---------------------------------------------------------------- common response path

    async def respond(
        self,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        request: Request,
        jobs: list[Job],
        rid: str,
        model: str,
        chat: bool,
        outputs: AsyncIterator[tuple[Job, RequestOutput]] | None = None,
    ) -> Response:
        """The response to ``jobs``, streamed or whole, from the engine's outputs (or from
        ``outputs``: a streamed echo of prompts with nothing generated)."""
        agen = self.run(jobs, delta=req.stream) if outputs is None else outputs
        try:
            if not req.stream:
                return await until_disconnect(
                    request, self._collect(req, agen, jobs, rid, model, chat)
                )
            first = await until_disconnect(request, first_output(agen))
        except BaseException as e:
            await agen.aclose()  # type: ignore[attr-defined]
            return failed(e, jobs[0])
        return StreamingResponse(
            sse_body(
                lambda: self.fingerprint_of(jobs[0]),
                self.logprobs,
                req,
                agen,
                first,
                jobs,
                rid,
                model,
                chat,
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _collect(
        self,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        agen: AsyncIterator[tuple[Job, RequestOutput]],
        jobs: list[Job],
        rid: str,
        model: str,
        chat: bool,
    ) -> JSONResponse:
        last: dict[int, RequestOutput] = {}
        try:
            async for job, out in agen:
                last[job.index] = out
        finally:
            await agen.aclose()  # type: ignore[attr-defined]
        choices: list[Any] = []
        completion_tokens = 0
        for job in jobs:
            out = last[job.index]
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                fields = choice_fields(self.logprobs, req, job, c, chat=chat, first=True)
                fields["stop_reason"] = c.stop_reason
                fields["dvr_metrics"] = dvr_metrics(out, job.params)
                choices.append((P.ChatChoice if chat else P.CompletionChoice)(**fields))
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": self.fingerprint_of(jobs[0]),
            "choices": choices,
            "usage": usage(
                sum(len(j.prompt_ids) for j in jobs),
                completion_tokens,
                sum(last[j.index].num_cached_tokens for j in jobs),
                jobs[0].reasoning_tokens(),
            ),
        }
        if chat:
            if req.return_token_ids:
                body["prompt_token_ids"] = jobs[0].prompt_ids
            if jobs[0].prompt_logprobs is not None:
                body["prompt_logprobs"] = jobs[0].prompt_logprobs
            response: Any = P.ChatCompletionResponse(**body)
        else:
            response = P.CompletionResponse(**body)
        return JSONResponse(response.model_dump(exclude_unset=True))

    # ---------------------------------------------------------------- tokenizer routes

    async def tokenize(
        self, req: P.TokenizeCompletionRequest | P.TokenizeChatRequest
    ) -> P.TokenizeResponse:
        self.check_model(req.model)
        if isinstance(req, P.TokenizeChatRequest):
            tools = None
            if req.tools is not None:
                check_tools(req.tools)
                tools = [t.model_dump(exclude_none=True) for t in req.tools]
            ids = await self.render_chat(
                req.messages,
                req.add_generation_prompt,
                req.chat_template_kwargs,
                tools,
                req.continue_final_message,
                req.chat_template,
                req.add_special_tokens,
            )
        else:
            ids = await self.encode(req.prompt, req.add_special_tokens)
        return P.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    async def detokenize(self, req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "tokens")
        bad = next((t for t in req.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"tokens contains token id {bad}, outside the vocabulary (size {self.vocab_size})",
                "tokens",
            )
        try:
            text = await asyncio.to_thread(self.tokenizer.decode, req.tokens)
        except InvalidRequestError as e:
            raise invalid(e, "tokens") from None
        return P.DetokenizeResponse(prompt=text)


def failed(e: BaseException, job: Job) -> Response:
    """The answer to a request whose run failed before its response began (its generation
    already closed): 499 for a client that left, the HTTP error of an engine error (a 400
    naming ``job``'s field for a bad request); anything else is raised again."""
    if isinstance(e, ClientGone):
        return Response(status_code=499)
    if not isinstance(e, DetspecError):
        raise e
    if isinstance(e, InvalidRequestError):
        raise job.invalid(e) from None
    err = engine_error(e)
    if err is None:
        raise e
    raise err from None


def check_max_tokens(req: P.CompletionRequest) -> None:
    """``max_tokens: 0`` means "score the prompt only", which needs ``echo``."""
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(
            400,
            "max_tokens=0 generates nothing: it is only allowed with echo=true (to score the "
            "prompt)",
            "max_tokens",
        )
