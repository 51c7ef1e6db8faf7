"""The per-request data the completion routes share: a ``Job`` (one prompt of a request, one
engine request), the prompts of ``/v1/completions`` and ``InFlight`` (the running jobs an
``/abort_request`` finds by rid). Its own module so that the modules that make jobs
(``serving``, ``scoring_routes``, ``native_routes``) and those that shape their outputs
(``shaping``, ``streaming``) depend on it, not on each other."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from detspec.errors import DetspecError, InvalidRequestError
from detspec.sampling_params import SamplingParams
from detspec.server.errors import ApiError
from detspec.server.harmony import HarmonyReader
from detspec.server.reasoning import ReasoningPlan, ReasoningSplit
from detspec.server.structured import Constraint, constraint_invalid
from detspec.server.tools import CallIds, ChoiceTools, ToolPlan

if TYPE_CHECKING:
    from detspec.async_llm import AsyncLLM
    from detspec.outputs import RequestOutput


@dataclass
class Job:
    """One prompt of a request (one engine request, ``n`` completions)."""

    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    constraint: Constraint | None = None
    # chat with tools: how the output becomes tool calls, and each choice's state
    tools: ToolPlan | None = None
    choice_tools: dict[int, ChoiceTools] = field(default_factory=dict)
    # chat with --reasoning-parser: how the output splits, and each choice's split
    reasoning: ReasoningPlan | None = None
    choice_reasoning: dict[int, ReasoningSplit | HarmonyReader] = field(default_factory=dict)
    # the LoRA adapter it runs with (its `model` names a loaded one), and the fingerprint the
    # engine gave it (which names the adapter's weights)
    lora: str | None = None
    fingerprint: str | None = None
    # vLLM's `cache_salt`: its prompt's prefix-cache pages are its salt's alone
    cache_salt: str | None = None
    # `echo` (vLLM's): what each choice's text begins with, a chat's last message (an
    # assistant's) or a streamed completion's prompt; and, with a completion's `logprobs`,
    # the prompt tokens' logprobs in OpenAI's completion form, leading the choice's first chunk
    echo: str | None = None
    echo_logprobs: dict[str, list[Any]] | None = None

    def invalid(self, e: InvalidRequestError, default_param: str | None = None) -> ApiError:
        """A 400 for an engine error, naming the request field behind it."""
        return constraint_invalid(e, self.constraint, default_param)

    def tools_of(self, choice: int) -> ChoiceTools | None:
        """The tool-call reader of one choice (None: its text is its content)."""
        if self.tools is None or not self.tools.parses_output:
            return None
        t = self.choice_tools.get(choice)
        if t is None:
            short = self.tools.parser is not None and self.tools.parser.short_ids
            ids = CallIds(bool(self.params.deterministic), self.params.seed, self.prompt_ids, short)
            t = self.choice_tools[choice] = ChoiceTools(self.tools, ids, choice)
        return t

    def reasoning_of(self, choice: int) -> ReasoningSplit | HarmonyReader | None:
        """The reasoning split of one choice (None: no reasoning parser)."""
        plan = self.reasoning
        if plan is None:
            return None
        s = self.choice_reasoning.get(choice)
        if s is None:
            calls = self.tools is not None and self.tools.reads_harmony
            s = self.choice_reasoning[choice] = plan.split(calls)
        return s

    def reasoning_tokens(self) -> int | None:
        """Completion tokens inside thinking blocks, over the choices so far (None: no
        reasoning parser)."""
        if self.reasoning is None:
            return None
        return sum(s.num_tokens for s in self.choice_reasoning.values())

    @property
    def keeps_special_tokens(self) -> bool:
        return keeps_special_tokens(self.tools, self.reasoning)


def keeps_special_tokens(tools: ToolPlan | None, reasoning: ReasoningPlan | None) -> bool:
    """Whether special tokens are decoded for a parser (a tool call's or reasoning's markers
    are special tokens); the stop token's text then comes off the answer."""
    if tools is not None and tools.keeps_special_tokens:
        return True
    return reasoning is not None and reasoning.parser.special


def completion_prompts(p: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """``/v1/completions``' ``prompt``: one text, one token list, or a list of either."""
    if isinstance(p, str):
        return [p]
    if not p:
        raise ApiError(400, "prompt is an empty list", "prompt")
    if isinstance(p[0], int):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


class InFlight:
    """The jobs a route has running, found by rid for SGLang's ``/abort_request``. It only
    finds them: the abort is the engine's own (``AsyncLLM.abort``, what a client disconnect
    triggers), so an aborted request ends as any abort does (finish reason ``abort``, its
    pages freed) and the others run on. ``AsyncLLM.abort`` finds a request from the moment
    its ``generate`` starts (before the engine has it too); a job is found here earlier,
    while the route still computes its prompt's logprobs (which wait while generation is
    paused) and before its run starts, where ``AsyncLLM`` does not know the rid yet. So an
    abort is also remembered per job and sent again at that job's next output (``watch``).
    Jobs are held by identity, not by rid, so a rid reused by a later request never
    inherits an earlier request's abort."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self._running: dict[int, Job] = {}  # id(job) -> job (held, so the id stays unique)
        self._asked: set[int] = set()  # jobs whose abort is to be sent again

    def add(self, jobs: Iterable[Job]) -> None:
        for j in jobs:
            self._running[id(j)] = j

    def remove(self, jobs: Iterable[Job]) -> None:
        for j in jobs:
            self._running.pop(id(j), None)
            self._asked.discard(id(j))

    async def abort(self, rid: str | None, abort_all: bool = False) -> list[str]:
        """Aborts the running jobs whose rid is ``rid``; with ``abort_all`` every one, and
        every other engine request of every route too. The rids aborted, each once (none for
        an unknown rid: nothing happens, as in SGLang)."""
        hit = [j for j in self._running.values() if abort_all or j.rid == rid]
        self._asked.update(id(j) for j in hit)
        rids = list(dict.fromkeys(j.rid for j in hit))
        if abort_all:
            seen = set(rids)
            rids += [r for r in self.engine.request_ids() if r not in seen]
        for r in rids:
            await self._engine_abort(r)
        return rids

    async def watch(
        self, jobs: list[Job], agen: AsyncIterator[tuple[Job, RequestOutput]]
    ) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """``agen`` (the run of ``jobs``, added before), sending a remembered abort again once
        its job has reached the engine; ``jobs`` are removed when it ends. Closing it closes
        ``agen``."""
        try:
            async with contextlib.aclosing(agen):  # type: ignore[type-var]
                async for job, out in agen:
                    if id(job) in self._asked and not out.finished:
                        self._asked.discard(id(job))
                        await self._engine_abort(job.rid)
                    yield job, out
        finally:
            self.remove(jobs)

    async def _engine_abort(self, rid: str) -> None:
        with contextlib.suppress(DetspecError):  # the engine has stopped: nothing to abort
            await self.engine.abort(rid)
