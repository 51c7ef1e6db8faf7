"""``ScoreBatcher``: the scoring twin of continuous batching. Concurrent prompt-logprob
requests (``echo`` in ``scoring_routes``) are coalesced into one engine call, so a plain
request's bits depend on what it was batched with, as a plain generation's do; a
deterministic one's do not. A call the engine refuses is retried prompt by prompt, so only
the request at fault gets the error. The server owns one (``OpenAIServer.score_batcher``)."""

from __future__ import annotations

import asyncio
from typing import Any

from detspec.async_llm import AsyncLLM
from detspec.outputs import Logprob

PromptLogprobs = list[dict[int, Logprob] | None]
# What one engine call shares: (k, deterministic, LoRA adapter).
# k, deterministic, LoRA adapter, cache salt: one engine call per key
_Key = tuple[int, bool, str | None, str | None]


class ScoreBatcher:
    """Coalesces concurrent prompt-logprob computations: a call that arrives while the engine
    scores others waits for the next engine call, which takes everything queued by then (one
    call per ``(k, deterministic, LoRA adapter)``). A call that arrives alone runs alone at
    once."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine
        self._queue: list[tuple[list[int], _Key, asyncio.Future[PromptLogprobs]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def prompt_logprobs(
        self,
        ids: list[int],
        k: int,
        deterministic: bool,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> PromptLogprobs:
        fut: asyncio.Future[PromptLogprobs] = asyncio.get_running_loop().create_future()
        self._queue.append((ids, (k, deterministic, lora, cache_salt), fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._run())
        return await fut

    async def _run(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            groups: dict[_Key, list[Any]] = {}
            for item in batch:
                groups.setdefault(item[1], []).append(item)
            for key, items in groups.items():
                live = [it for it in items if not it[2].done()]  # cancelled: client left
                if live:
                    await self._score(live, key)

    async def _score(self, items: list[Any], key: _Key) -> None:
        """One engine call for `items`; if it fails, each alone, so a request the engine
        refuses gets its own error and the others their results."""
        k, det, lora, salt = key
        try:
            res = await self._engine.prompt_logprobs(
                [it[0] for it in items], k, deterministic=det, lora_request=lora, cache_salt=salt
            )
        except Exception as e:
            if len(items) > 1:
                for it in items:
                    await self._score([it], key)
                return
            if not items[0][2].done():
                items[0][2].set_exception(e)
            return
        for it, r in zip(items, res, strict=True):
            if not it[2].done():
                it[2].set_result(r)
