"""ASGI middleware that runs before anything parses the body: the API key (constant-time
comparison) and the request-size limit (chunked bodies are read up to the limit); and
``X-Request-Id`` on every response where asked for."""

from __future__ import annotations

import hmac
import json
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from detspec.server.admin_routes import INFO_PATHS
from detspec.server.errors import error_body
from detspec.server.lora_routes import LORA_PATHS
from detspec.server.native_routes import NATIVE_PATHS
from detspec.server.rl_routes import RL_PATHS, WEIGHT_UPLOAD_PATHS

# Paths that need the API key when one is set (vLLM protects /v1; the tokenizer routes too).
PROTECTED_PREFIXES = (
    "/v1",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    *RL_PATHS,
    *NATIVE_PATHS,
    *LORA_PATHS,
    *INFO_PATHS,
)


class GuardMiddleware:
    """API key and request-size limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    async def _reject(self, send: Send, status: int, msg: str, param: str | None) -> None:
        headers = [(b"content-type", b"application/json")]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        body = json.dumps(error_body(status, msg, param)).encode()
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path: str = scope.get("path", "")
        if self.api_key is not None and path.startswith(PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
            if not ok:
                await self._reject(
                    send,
                    401,
                    "missing or incorrect API key in the `Authorization` header "
                    "(expected `Bearer <key>`)",
                    "Authorization",
                )
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                await self._reject(send, 400, "invalid Content-Length header", "Content-Length")
                return
            if n > self.max_bytes and path not in WEIGHT_UPLOAD_PATHS:
                await self._reject(send, 413, self._too_large(n), "body")
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # Chunked body: read it up to the limit, then replay it to the app.
        buffered: list[Message] = []
        total = 0
        while True:
            msg = await receive()
            buffered.append(msg)
            if msg["type"] != "http.request":
                break
            total += len(msg.get("body", b""))
            if total > self.max_bytes and path not in WEIGHT_UPLOAD_PATHS:
                await self._reject(send, 413, self._too_large(total), "body")
                return
            if not msg.get("more_body", False):
                break

        async def replay() -> Message:
            if buffered:
                return buffered.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, n: int) -> str:
        return (
            f"request body of {n} bytes is over the server's limit of {self.max_bytes} bytes "
            "(--max-request-bytes)"
        )


class RequestIdMiddleware:
    """vLLM's ``--enable-request-id-headers``: every response carries ``X-Request-Id``, the
    client's own where it sent one (so a proxy's or a harness's id can be followed through the
    logs), else a fresh one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or []).get(b"x-request-id")
        rid = sent if sent else uuid.uuid4().hex.encode()

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, with_id)
