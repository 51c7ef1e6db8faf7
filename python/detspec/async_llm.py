"""``AsyncLLM``: streaming generation for asyncio servers, shaped like vLLM's."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from detspec import _core
from detspec.errors import DetspecError, EngineStoppedError
from detspec.llm import PromptType, _EngineClient, _prompts_and_salts, _rewards
from detspec.lora import LoRAType
from detspec.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from detspec.sampling_params import SamplingParams
from detspec.scoring import AuditReport


class _Pending:
    """One ``generate`` call accepted but not yet handed to the engine (still awaiting its LoRA
    adapter or its prompt's logprobs); ``aborted``: ``abort`` named its id meanwhile."""

    __slots__ = ("aborted",)

    def __init__(self) -> None:
        self.aborted = False


class AsyncLLM(_EngineClient):
    """Continuous-batching engine with an asyncio streaming API.

    ``async for out in engine.generate(prompt, params, request_id="r1")`` yields cumulative
    ``RequestOutput`` snapshots as tokens are committed (``delta=True``: what is new in
    each); the last has ``finished=True``.
    Cancelling the consuming task (or breaking out of the loop) aborts the request.
    """

    def _setup(self) -> None:
        self._queue = _core.OutputQueue()
        # request id -> (event loop, asyncio.Queue) of its consumer
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        # request id -> the `generate` calls with that id not yet handed to the engine (which
        # ignores an abort of an id it does not know): `abort` marks them
        self._pending: dict[str, list[_Pending]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._dispatcher: threading.Thread | None = None

    def _ensure_dispatcher(self) -> None:
        with self._lock:
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(
                    target=self._dispatch, name="detspec-async-dispatch", daemon=True
                )
                self._dispatcher.start()

    def _dispatch(self) -> None:
        """Moves outputs from the engine to each request's asyncio queue. Blocks in Rust
        (without the GIL) while nothing happens; wakes once a second to notice shutdown, and
        after shutdown drains what is left (the abort outputs) before exiting."""
        while True:
            closed = self._closed
            outs = self._queue.next_outputs(0.05 if closed else 1.0)
            if closed and not outs:
                return
            for rid, d, exc in outs:
                with self._lock:
                    target = self._streams.get(rid)
                if target is None:
                    continue
                loop, q = target
                item: Any = exc if exc is not None else d
                try:
                    loop.call_soon_threadsafe(q.put_nowait, item)
                except RuntimeError:  # the consumer's loop is closed
                    pass

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        delta: bool = False,
        lora_request: LoRAType = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of one request: cumulative snapshots, or with ``delta=True``
        (vLLM's ``RequestOutputKind.DELTA``) only what is new in each (``token_ids``,
        ``text`` and ``logprobs`` of each completion; finish and stop reasons, the
        cumulative logprob and metrics as in a snapshot). ``lora_request``: the LoRA adapter
        it runs with (a ``LoRARequest`` is loaded the first time its name is used).

        From its first iteration the request is ``abort``-able, also while it still awaits its
        adapter or its prompt's logprobs (before the engine has it): it is then submitted as
        aborted, and the engine ends it before its first step (finish reason ``abort``, no
        tokens)."""
        if self._closed:
            raise EngineStoppedError("engine is shut down")
        (p,), (salt,) = _prompts_and_salts([prompt])
        params = sampling_params or SamplingParams()
        rid = request_id if request_id is not None else self._new_request_id()
        pending = _Pending()
        with self._lock:
            self._pending.setdefault(rid, []).append(pending)
        try:
            lora = (
                await asyncio.to_thread(self._lora_name, lora_request)
                if lora_request is not None
                else None
            )
            prompt_logprobs = None
            if params.prompt_logprobs is not None and not pending.aborted:
                (prompt_logprobs,) = await asyncio.to_thread(
                    self._prompt_logprobs_first, [p], [params], [lora], [salt]
                )
            q: asyncio.Queue[Any] = asyncio.Queue()
            # Submitted under the lock the dispatcher takes to find a request's consumer, so
            # no output arrives before the consumer is registered; the engine refuses a
            # duplicate id before anything is registered, so the running request with that id
            # is neither detached from its consumer nor aborted. The pending window ends under
            # the same lock as `abort` marks it: an abort either marked this call (which is
            # then submitted as aborted: the engine accepts it and ends it in one command, with
            # its own abort output) or finds the request in the engine.
            with self._lock:
                self._end_pending(rid, pending)
                self._engine.add_request(
                    self._queue, rid, p, params.to_dict(), delta, lora, salt, pending.aborted
                )
                self._streams[rid] = (asyncio.get_running_loop(), q)
        except BaseException:
            with self._lock:
                self._end_pending(rid, pending)
            raise
        self._ensure_dispatcher()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                out = self._to_output(item, params)
                finished = out.finished
                out.prompt_logprobs = prompt_logprobs
                yield out
                if finished:
                    return
        finally:
            with self._lock:
                # A finished request's id may already serve a new request: drop only ours.
                if self._streams.get(rid, (None, None))[1] is q:
                    del self._streams[rid]
            if not finished:
                try:
                    self._engine.abort(rid)
                except DetspecError:  # already shut down: nothing left to abort
                    pass

    async def score(
        self,
        prompts: PromptType | Sequence[PromptType],
        completions: Sequence[str | Sequence[int]],
        deterministic: bool = True,
        *,
        lora_request: LoRAType = None,
        cache_salt: str | None = None,
    ) -> list[list[float]]:
        """``LLM.score``, awaitable: runs between engine steps while other requests stream."""
        return await asyncio.to_thread(
            self._score, prompts, completions, deterministic, lora_request, cache_salt
        )

    async def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling: str = "last",
        dimensions: int | None = None,
        normalize: bool = True,
        deterministic: bool = True,
        lora_request: LoRAType | Sequence[LoRAType] = None,
    ) -> list[EmbeddingRequestOutput]:
        """``LLM.embed``, awaitable: runs between engine steps while other requests stream."""
        return await asyncio.to_thread(
            self._embed, prompts, pooling, dimensions, normalize, deterministic, lora_request
        )

    async def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        deterministic: bool = True,
        lora_request: LoRAType | Sequence[LoRAType] = None,
    ) -> list[ClassificationRequestOutput]:
        """``LLM.classify``, awaitable: runs between engine steps while other requests stream."""
        return await asyncio.to_thread(self._classify, prompts, deterministic, lora_request)

    async def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        deterministic: bool = True,
        lora_request: LoRAType | Sequence[LoRAType] = None,
    ) -> list[PoolingRequestOutput]:
        """``LLM.reward``, awaitable."""
        classified = await self.classify(
            prompts, deterministic=deterministic, lora_request=lora_request
        )
        return _rewards(classified)

    async def update_weights(self, named_tensors: Any, *, in_flight: str = "finish") -> None:
        """``LLM.update_weights``, awaitable: with ``in_flight="finish"`` it returns once the
        requests in flight have finished on the old weights and the new ones are in place."""
        await asyncio.to_thread(self._update_weights, named_tensors, in_flight)

    async def update_weights_from_disk(
        self, path: str | os.PathLike[str], *, in_flight: str = "finish", complete: bool = False
    ) -> None:
        """``LLM.update_weights_from_disk``, awaitable."""
        await asyncio.to_thread(
            self._engine.update_weights_from_checkpoint, os.fspath(path), in_flight, complete
        )

    async def update_weights_from_safetensors(
        self, data: bytes, *, in_flight: str = "finish"
    ) -> None:
        """``LLM.update_weights_from_safetensors``, awaitable."""
        await asyncio.to_thread(self._engine.update_weights_from_safetensors, data, in_flight)

    async def prompt_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        k: int = 0,
        *,
        deterministic: bool = True,
        lora_request: LoRAType = None,
        cache_salt: str | None = None,
    ) -> list[list[dict[int, Any] | None]]:
        """``LLM.prompt_logprobs``, awaitable (one engine call for all ``prompts``)."""
        return await asyncio.to_thread(
            self._prompt_logprobs, prompts, k, deterministic, lora_request, cache_salt
        )

    async def pause(self, mode: str = "abort") -> None:
        """Pauses generation: requests (and scoring calls) submitted from now on wait until
        ``resume``. ``mode`` says what happens to the requests in flight: ``"abort"`` aborts
        them (finish reason ``abort``), ``"wait"`` returns once they have finished, ``"keep"``
        freezes them where they are (they go on after ``resume``, with the same bits for
        deterministic requests)."""
        await asyncio.to_thread(self._engine.pause, mode)

    async def resume(self) -> None:
        """Resumes generation after ``pause`` (fails while the KV memory is released)."""
        await asyncio.to_thread(self._engine.resume)

    @property
    def is_closed(self) -> bool:
        """Whether ``shutdown`` has run (no more requests are accepted)."""
        return self._closed

    @property
    def is_paused(self) -> bool:
        return bool(self._engine.is_paused())

    async def reset_prefix_cache(self) -> int:
        """``LLM.reset_prefix_cache``, awaitable."""
        return int(await asyncio.to_thread(self._engine.reset_prefix_cache))

    async def release_memory(self) -> None:
        """Frees the KV cache's memory (the pool's tensors are dropped). Generation must be
        paused with no request in flight (``pause("abort")`` or ``pause("wait")``)."""
        await asyncio.to_thread(self._engine.release_kv_memory)

    async def resume_memory(self) -> None:
        """Allocates the KV cache again after ``release_memory``; then ``resume``."""
        await asyncio.to_thread(self._engine.resume_kv_memory)

    async def kv_memory(self) -> tuple[int, bool]:
        """``(bytes the KV cache holds, whether it is released)``."""
        n, released = await asyncio.to_thread(self._engine.kv_memory)
        return int(n), bool(released)

    async def audit(
        self,
        output: RequestOutput,
        sampling_params: SamplingParams | None = None,
        *,
        lora_request: LoRAType = None,
    ) -> AuditReport:
        """``LLM.audit``, awaitable."""
        return await asyncio.to_thread(self._audit, output, sampling_params, lora_request)

    async def abort(self, request_id: str) -> None:
        """Aborts a request; its stream ends with finish_reason "abort". A request that
        ``generate`` has not yet handed to the engine (awaiting its adapter or its prompt's
        logprobs) is submitted as aborted (see ``generate``); an unknown id is ignored."""
        with self._lock:
            for pending in self._pending.get(request_id, ()):
                pending.aborted = True
        # Outside the lock (the engine answers between steps): a `generate` that reaches its
        # submission after the lock was released was marked above and submits as aborted.
        self._engine.abort(request_id)

    def request_ids(self) -> list[str]:
        """The ids of the requests streaming now (``generate`` calls not yet finished), those
        not yet handed to the engine included."""
        with self._lock:
            return list(dict.fromkeys([*self._streams, *self._pending]))

    def _end_pending(self, rid: str, pending: _Pending) -> None:
        """Ends ``pending``'s window (under ``self._lock``; again is a no-op): an abort after
        it goes to the engine, and a later request with the id is not marked by it."""
        calls = self._pending.get(rid)
        if calls is not None and pending in calls:
            calls.remove(pending)
            if not calls:
                del self._pending[rid]

    def shutdown(self) -> None:
        """Stops the engine; in-flight streams end with finish_reason "abort"."""
        super().shutdown()  # joins the engine thread: every abort output is queued by now
        self._closed = True
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=5)
