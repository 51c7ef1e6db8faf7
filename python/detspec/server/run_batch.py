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

``--compare PREVIOUS`` audits a rerun: each answer is compared with the same ``custom_id``'s in
an earlier output file, leaving out what may change without the answer changing (ids,
timestamps, prefix-cache counts, ``dvr_metrics``); the first differing field of each answer
that moved is printed, and the exit status is 1 if any did (answers of another fingerprint
are reported as not comparable).
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
    from detspec.server.serve_flags import add_app_arguments

    p.add_argument("-i", "--input-file", required=True, help="the requests, JSON lines")
    p.add_argument("-o", "--output-file", required=True, help="the answers, JSON lines")
    p.add_argument(
        "--compare",
        default=None,
        metavar="PREVIOUS",
        help="an earlier output file of the same requests: report the answers that differ "
        "from it (exit status 1 if any)",
    )
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
        try:
            body: Any = r.json()
        except ValueError:  # not JSON (no route answers so; kept as text if one did)
            body = r.text
        request_id = body.get("id") if r.status_code == 200 and isinstance(body, dict) else None
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


# Fields that may change while the answer does not: per body, per choice or item, in usage.
_VOLATILE = {"id", "created", "created_at", "dvr_metrics"}
_VOLATILE_USAGE = {"prompt_tokens_details", "input_tokens_details"}


def stable_answer(out: dict[str, Any]) -> Any:
    """An output line's answer without what may change while it does not (the status code
    and the body; ``error`` for a line that was not sent)."""
    r = out.get("response")
    if r is None:
        return {"error": out.get("error")}
    body = r.get("body")
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in _VOLATILE}
        if isinstance(body.get("usage"), dict):
            body["usage"] = {k: v for k, v in body["usage"].items() if k not in _VOLATILE_USAGE}
        for key in ("choices", "output"):
            if isinstance(body.get(key), list):
                body[key] = [
                    {k: v for k, v in x.items() if k not in _VOLATILE} if isinstance(x, dict) else x
                    for x in body[key]
                ]
    return {"status_code": r.get("status_code"), "body": body}


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The path of the first field where ``a`` and ``b`` differ (None: equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d is not None:
                return d
        return None if len(a) == len(b) else f"{path} (length {len(a)} vs {len(b)})"
    return None if a == b else (path or "(the line)")


def _fingerprint(out: dict[str, Any]) -> str | None:
    r = out.get("response") or {}
    body = r.get("body")
    return body.get("system_fingerprint") if isinstance(body, dict) else None


def compare(previous: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """(the number of answers that differ, a line per answer not found the same)."""
    before = {o.get("custom_id"): o for o in previous if o.get("custom_id") is not None}
    report: list[str] = []
    differ = 0
    for out in outputs:
        cid = out.get("custom_id")
        if cid is None:
            continue
        old = before.get(cid)
        if old is None:
            report.append(f"{cid}: not in the previous file")
            differ += 1
            continue
        fa, fb = _fingerprint(old), _fingerprint(out)
        if fa is not None and fb is not None and fa != fb:
            report.append(f"{cid}: not comparable, fingerprint {fa} then {fb}")
            continue
        where = first_difference(stable_answer(old), stable_answer(out))
        if where is not None:
            report.append(f"{cid}: differs at {where}")
            differ += 1
    return differ, report


def run_batch(args: argparse.Namespace) -> int:
    from detspec.server.serve import SetupError, build_from_args, missing_extra

    missing = missing_extra("run-batch")
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    try:
        with open(args.input_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
        previous = None
        if args.compare is not None:
            with open(args.compare, encoding="utf-8") as f:
                previous = [json.loads(x) for x in f.read().splitlines() if x.strip()]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
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
    if previous is None:
        return 0
    differ, report = compare(previous, outputs)
    for line in report:
        print(line, file=sys.stderr)
    same = sum(o.get("custom_id") is not None for o in outputs) - len(report)
    print(f"compared with {args.compare}: {same} same, {differ} differ", file=sys.stderr)
    return 1 if differ else 0
