"""``detspec serve``: builds the engine and the app and runs them under uvicorn.

SIGINT/SIGTERM: stop accepting connections, let in-flight requests finish for up to
``--shutdown-timeout`` seconds, abort the rest (their KV pages come back), shut the engine
down and exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Generator
from typing import Any

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``vllm serve``'s flag names where one exists."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory (default: the built-in default model, detspec-tiny-en)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes (or set DETSPEC_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the model directory's name)",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N (cuda needs the CUDA wheel)"
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="weights and KV cache (auto: the checkpoint's dtype where the device runs it "
        "(bfloat16 on cpu and cuda, float16 on cuda), else float32)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="KV cache (auto: the model's dtype; cpu: float32 or bfloat16)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-kv-pages", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--determinism", choices=("dvr", "batch_invariant", "off"), default="dvr")
    p.add_argument("--verify-window", type=int, default=64)
    p.add_argument("--verify-group", type=int, default=8)
    p.add_argument(
        "--verify-strategy",
        choices=("auto", "replay", "inline"),
        default="auto",
        help="how DVR makes deterministic rows reproducible (auto: inline on CPU)",
    )
    p.add_argument("--verify-finish-wait", type=int, default=0)
    p.add_argument(
        "--deterministic-by-default",
        action="store_true",
        help="requests that do not send `deterministic` are deterministic (send "
        '"deterministic": false to opt out); reported in system_fingerprint and /v1/models',
    )
    p.add_argument(
        "--default-seed",
        type=int,
        default=0,
        help="under --deterministic-by-default, the seed of sampled requests that send none "
        "(default 0)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV pages of shared prompt prefixes (default on)",
    )
    p.add_argument("--num-threads", type=int, default=None, help="engine CPU threads")
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 (with Retry-After) when more sequences than this would wait",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="answer 413 to larger request bodies (default 16 MiB)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM",
    )
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")


def serve(args: argparse.Namespace) -> int:
    from detspec.server import missing_dependencies

    missing = missing_dependencies()
    if missing:
        print(
            f"error: `detspec serve` needs {', '.join(missing)}: "
            "install the server extra with  pip install 'detspec[serve]'",
            file=sys.stderr,
        )
        return 1

    import uvicorn

    from detspec.async_llm import AsyncLLM
    from detspec.errors import DetspecError
    from detspec.server.app import ServerConfig, build_app

    api_key = args.api_key or os.environ.get("DETSPEC_API_KEY") or None
    if args.deterministic_by_default and args.determinism == "off":
        print(
            "error: --deterministic-by-default needs --determinism dvr or batch_invariant",
            file=sys.stderr,
        )
        return 1
    if args.host not in _LOOPBACK and api_key is None:
        print(
            f"warning: binding {args.host} without an API key: anyone who can reach this port "
            "can use the server (set --api-key or DETSPEC_API_KEY)",
            file=sys.stderr,
        )
    try:
        engine = AsyncLLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_pages=args.num_kv_pages,
            page_size=args.page_size,
            max_model_len=args.max_model_len,
            determinism=args.determinism,
            verify_window=args.verify_window,
            verify_group=args.verify_group,
            verify_finish_wait=args.verify_finish_wait,
            verify_strategy=args.verify_strategy,
            enable_prefix_caching=args.enable_prefix_caching,
            num_threads=args.num_threads,
        )
    except DetspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    names = args.served_model_name or [os.path.basename(os.path.normpath(engine.model))]
    config = ServerConfig(
        served_model_names=names,
        api_key=api_key,
        max_waiting_requests=args.max_waiting_requests,
        max_request_bytes=args.max_request_bytes,
        max_num_seqs=args.max_num_seqs,
        determinism=args.determinism,
        deterministic_by_default=args.deterministic_by_default,
        default_seed=args.default_seed,
    )
    app = build_app(engine, config)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=5,
    )
    server = _Server(uv_config, app.state.server)
    logging.getLogger("detspec.server").info(
        "serving %s as %s on http://%s:%d", engine.model, names, args.host, args.port
    )
    try:
        server.run()
    finally:
        with contextlib.suppress(Exception):
            engine.shutdown()
    return 0 if server.started or server.should_exit else 1


class _Server:
    """uvicorn's server, but a signal ends it with exit 0 (uvicorn re-raises the signal after
    its graceful shutdown, which would make the process die of it)."""

    def __init__(self, config: Any, state: Any) -> None:
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                state.draining = True
                super().handle_exit(sig, frame)

            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                with super().capture_signals():
                    try:
                        yield
                    finally:
                        outer.signals = list(self._captured_signals)
                        self._captured_signals.clear()

        self.signals: list[int] = []
        self._server = Server(config)

    @property
    def started(self) -> bool:
        return bool(self._server.started)

    @property
    def should_exit(self) -> bool:
        return bool(self._server.should_exit)

    def run(self) -> None:
        self._server.run()
        if self.signals:
            names = ", ".join(signal.Signals(s).name for s in self.signals)
            print(f"detspec serve: stopped on {names}", file=sys.stderr)
