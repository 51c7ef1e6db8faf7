"""``detspec run-batch``: a file of requests in OpenAI's batch format, answered offline (vLLM's
``run_batch``), for evals that want their answers in a file rather than from a server.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of
``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``; each output line (in input
order) is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.
The bodies go through the server's own app in process (``httpx``'s ASGI transport, no socket),
so a line is checked, run and answered exactly as ``detspec serve`` answers it: a bad request
is a 400 body naming its field, and the other lines run. ``error`` is set only for a line that
could not be sent (not JSON, a missing field, another URL or method, ``stream``).

Lines run concurrently (``--max-concurrency`` at a time), so the engine batches them as a
server batches its clients; with ``--deterministic-by-default`` (or ``"deterministic": true``
in a body) every answer is bitwise the same whatever the concurrency, the batch size limits
or the other lines of the file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def add_run_batch_arguments(p: argparse.ArgumentParser) -> None:
    from detspec.server.serve import add_app_arguments

    p.add_argument("-i", "--input-file", required=True, help="the requests, JSON lines")
    p.add_argument("-o", "--output-file", required=True, help="the answers, JSON lines")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=256,
        help="lines in flight at once (default 256; the engine runs --max-num-seqs of them)",
    )
    add_app_arguments(p)


def _line_error(custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def _request(n: int, line: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Line ``n``'s request, or the output line that says why it cannot be sent."""
    try:
        item = json.loads(line)
    except ValueError as e:
        return None, _line_error(None, "invalid_json", f"line {n}: not JSON: {e}")
    if not isinstance(item, dict):
        return None, _line_error(None, "invalid_request", f"line {n}: not a JSON object")
    custom_id = item.get("custom_id")
    url, method, body = item.get("url"), item.get("method", "POST"), item.get("body")
    if method != "POST":
        return None, _line_error(custom_id, "invalid_request", f"line {n}: method must be POST")
    if url not in URLS:
        return None, _line_error(
            custom_id, "invalid_url", f"line {n}: url {url!r} is not one of {', '.join(URLS)}"
        )
    if not isinstance(body, dict):
        return None, _line_error(custom_id, "invalid_request", f"line {n}: body must be an object")
    if body.get("stream"):
        return None, _line_error(
            custom_id, "invalid_request", f"line {n}: stream is not supported in a batch"
        )
    return item, None


async def answer_lines(app: Any, lines: list[str], max_concurrency: int) -> list[dict[str, Any]]:
    """The output line of each input line (blank lines skipped), in order."""
    import httpx

    gate = asyncio.Semaphore(max(1, max_concurrency))
    transport = httpx.ASGITransport(app=app)

    async def one(client: httpx.AsyncClient, n: int, line: str) -> dict[str, Any]:
        item, failed = _request(n, line)
        if failed is not None:
            return failed
        assert item is not None
        async with gate:
            r = await client.post(item["url"], json=item["body"])
        body = r.json()
        request_id = body.get("id") if r.status_code == 200 else None
        return {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": item.get("custom_id"),
            "response": {
                "status_code": r.status_code,
                "request_id": request_id or f"req_{uuid.uuid4().hex}",
                "body": body,
            },
            "error": None,
        }

    async with httpx.AsyncClient(
        transport=transport, base_url="http://run-batch", timeout=None
    ) as client:
        jobs = [one(client, n, line) for n, line in enumerate(lines, 1) if line.strip()]
        return list(await asyncio.gather(*jobs))


def run_batch(args: argparse.Namespace) -> int:
    from detspec.server.serve import SetupError, build_from_args, missing_extra

    missing = missing_extra("run-batch")
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    try:
        with open(args.input_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        print(f"error: --input-file: {e}", file=sys.stderr)
        return 1
    try:
        app = build_from_args(args)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    engine = app.state.server.engine
    try:
        outputs = asyncio.run(answer_lines(app, lines, args.max_concurrency))
    finally:
        engine.shutdown()
    try:
        with open(args.output_file, "w", encoding="utf-8") as f:
            for out in outputs:
                f.write(json.dumps(out) + "\n")
    except OSError as e:
        print(f"error: --output-file: {e}", file=sys.stderr)
        return 1
    failed = sum(o["error"] is not None or o["response"]["status_code"] != 200 for o in outputs)
    print(f"{len(outputs)} requests, {failed} failed -> {args.output_file}", file=sys.stderr)
    return 0
