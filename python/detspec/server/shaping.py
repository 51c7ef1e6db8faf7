"""The fields of a completion or chat response that every body shares: a choice (text or
message, tool calls, logprobs, token ids), ``usage`` and ``dvr_metrics``. The JSON bodies
(``serving``, ``scoring_routes``) and the SSE chunks (``streaming``) are all shaped here,
from what they are given (the job, the output, a ``LogprobShaper``), so that none of them
needs the server object."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from detspec.outputs import RequestOutput
from detspec.sampling_params import SamplingParams
from detspec.server import protocol as P
from detspec.server.harmony import HarmonyReader
from detspec.server.jobs import Job
from detspec.server.logprobs import LogprobShaper
from detspec.server.tool_parsers import Parsed


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
    reasoning_tokens: int | None = None,
) -> P.UsageInfo:
    """OpenAI's token counts; ``cached_tokens``: prompt tokens read from the prefix cache
    (``RequestOutput.num_cached_tokens`` summed over the request's prompts);
    ``reasoning_tokens``: completion tokens inside thinking blocks (``Job.reasoning_tokens``)."""
    counts = P.UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    if cached_tokens is not None:
        counts.prompt_tokens_details = P.PromptTokensDetails(cached_tokens=cached_tokens)
    if reasoning_tokens is not None:
        counts.completion_tokens_details = P.CompletionTokensDetails(
            reasoning_tokens=reasoning_tokens
        )
    return counts


def dvr_metrics(out: RequestOutput, params: SamplingParams) -> P.DvrMetrics:
    mt = out.metrics
    return P.DvrMetrics(
        deterministic=bool(params.deterministic),
        num_verify_passes=int(mt.get("num_verify_passes", 0)),
        num_rollbacks=int(mt.get("num_rollbacks", 0)),
        num_rolled_back_tokens=int(mt.get("num_rolled_back_tokens", 0)),
        num_padded_rows=int(mt.get("num_padded_rows", 0)),
        num_preemptions=int(mt.get("num_preemptions", 0)),
    )


def choice_fields(
    logprobs: LogprobShaper,
    req: P.CompletionRequest | P.ChatCompletionRequest,
    job: Job,
    c: Any,
    *,
    chat: bool,
    first: bool,
    text_offset: int = 0,
    stream: bool = False,
) -> dict[str, Any]:
    """One choice of a response (or, with ``stream``, of a chunk: ``c`` holds what is
    new) without its finish fields; ``first``: the choice's first appearance, which
    carries the prompt fields."""
    k = job.params.logprobs
    lps = c.logprobs or []
    as_ids = req.return_tokens_as_token_ids
    fields: dict[str, Any] = {"index": job.index * job.params.n + c.index}
    finish_reason = c.finish_reason
    if chat:
        reasoning, content, calls, finish_reason = _answer(job, c, logprobs.decode_token)
        tools = job.tools_of(c.index)
        split = job.reasoning_of(c.index)
        show = job.reasoning is not None and job.reasoning.include
        if stream:
            if first and job.echo:
                content = job.echo + (content or "")
            fields["delta"] = {"role": "assistant"} if first else {}
            if show and reasoning:
                fields["delta"]["reasoning"] = fields["delta"]["reasoning_content"] = reasoning
            if content or "reasoning" not in fields["delta"]:
                fields["delta"]["content"] = content
            if calls:
                fields["delta"]["tool_calls"] = calls
        else:
            if tools is not None:
                fields["message"] = tools.message()
            else:
                fields["message"] = {"role": "assistant", "content": content}
            if split is not None:
                if not fields["message"]["content"]:
                    fields["message"]["content"] = None
                said = split.reasoning if show and split.began_thinking else None
                fields["message"]["reasoning"] = fields["message"]["reasoning_content"] = said
            if job.echo:
                fields["message"]["content"] = job.echo + (fields["message"]["content"] or "")
        fields["logprobs"] = logprobs.chat(lps, k, as_ids) if k is not None else None
    else:
        echo = job.echo if first and job.echo is not None else ""
        fields["text"] = echo + c.text
        fields["logprobs"] = None
        if k is not None:
            lp = logprobs.completion(lps, k, text_offset + len(echo), as_ids)
            if first and job.echo_logprobs is not None:
                lp = {key: [*job.echo_logprobs[key], *lp[key]] for key in lp}
            fields["logprobs"] = lp
        if first:
            if req.return_token_ids:
                fields["prompt_token_ids"] = job.prompt_ids
            if job.prompt_logprobs is not None:
                fields["prompt_logprobs"] = job.prompt_logprobs
    fields["finish_reason"] = finish_reason
    if req.return_token_ids:
        fields["token_ids"] = list(c.token_ids)
    return fields


def _answer(
    job: Job, c: Any, decode_token: Callable[[int], str]
) -> tuple[str, str, list[dict[str, Any]], str | None]:
    """A chat choice's new output (``c``: all of it, or a stream's delta) as its reasoning,
    its content, its tool-call deltas and its finish reason (``tool_calls`` when calls
    ended it). The reasoning split comes first; a tool reader sees the answer only (a named
    tool's call opens with the answer's first text). Harmony's reader parses the calls
    too, and hands them to the tool reader parsed."""
    text = c.text
    if job.keeps_special_tokens:
        text = strip_stop_token(text, c, decode_token)
    finish_reason = c.finish_reason
    reasoning = ""
    split = job.reasoning_of(c.index)
    answer: Parsed | None = None
    if isinstance(split, HarmonyReader):
        reasoning, answer = split.feed(text, c.token_ids)
        if finish_reason is not None:
            more_reasoning, more = split.finish()
            reasoning += more_reasoning
            answer.extend(more)
        text = answer.content
    elif split is not None:
        reasoning, text = split.feed(text, c.token_ids)
        if finish_reason is not None:
            reasoning += split.finish()
    tools = job.tools_of(c.index)
    if tools is None:
        return reasoning, text, [], finish_reason
    content, calls = "", []
    if answer is not None:
        content, calls = tools.take(answer)
    elif split is None or not split.thinking:
        content, calls = tools.feed(text)
    if finish_reason is not None:
        more_content, more_calls, finish_reason = tools.finish(finish_reason)
        content += more_content
        calls += more_calls
    return reasoning, content, calls, finish_reason


def strip_stop_token(text: str, c: Any, decode_token: Callable[[int], str]) -> str:
    """``text`` without the stop token's text at its end (decoded when special tokens are
    kept for a tool parser; it is not part of the answer)."""
    if c.finish_reason == "stop" and isinstance(c.stop_reason, int):
        tail = decode_token(c.stop_reason)
        if tail and text.endswith(tail):
            return text[: -len(tail)]
    return text
