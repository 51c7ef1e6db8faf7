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
from pathlib import Path
from typing import Any

from detspec.engine_args import SETTINGS_BY_NAME, engine_settings_from_args

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules``' ``(name, path)`` pairs; ``SetupError`` for a malformed one."""
    import json

    out = []
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                out.append((str(d["name"]), str(d["path"])))
            except (ValueError, KeyError, TypeError):
                raise SetupError(
                    f"--lora-modules {spec!r}: expected JSON with `name` and `path`"
                ) from None
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SetupError(f"--lora-modules {spec!r}: expected NAME=PATH")
        out.append((name, path))
    return out


class SetupError(Exception):
    """A setting that cannot be served; its message is printed as ``error: ...``."""


def missing_extra(command: str) -> str | None:
    """The error when the server extra is not installed."""
    from detspec.server import missing_dependencies

    missing = missing_dependencies()
    if not missing:
        return None
    return (
        f"`detspec {command}` needs {', '.join(missing)}: install the server extra with  "
        "pip install 'detspec[serve]'"
    )


def build_from_args(args: argparse.Namespace, **config: Any) -> Any:
    """The engine and the app of ``add_app_arguments``' flags (``config``: more
    ``ServerConfig`` fields); ``SetupError`` for flags that cannot go together or a model
    that cannot be served. The app (``app.state.server.engine``: its engine) shuts the
    engine down at the end of its lifespan."""
    from detspec.async_llm import AsyncLLM
    from detspec.errors import DetspecError
    from detspec.server.app import ServerConfig, build_app

    for flag in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(args, flag) != 1:
            raise SetupError(
                f"--{flag.replace('_', '-')} {getattr(args, flag)}: an engine runs on one "
                "device; serve more with Ray replicas (docs/scaling.md)"
            )
    settings = engine_settings_from_args(args)
    determinism = settings.get("determinism", SETTINGS_BY_NAME["determinism"].default)
    if args.deterministic_by_default and determinism == "off":
        raise SetupError("--deterministic-by-default needs --determinism dvr or batch_invariant")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SetupError("--enable-auto-tool-choice needs --tool-call-parser")
    adapters = lora_modules(args.lora_modules)
    if adapters and not settings.get("enable_lora"):
        raise SetupError("--lora-modules needs --enable-lora")
    try:
        engine = AsyncLLM(args.model, **settings)
    except DetspecError as e:
        raise SetupError(str(e)) from None
    names = args.served_model_name or [os.path.basename(os.path.normpath(engine.model))]
    for name, path in adapters:
        try:
            if name in names:
                raise SetupError(f"--lora-modules {name}: the base model is served as {name}")
            engine.load_lora(name, os.path.expanduser(path))
        except (DetspecError, SetupError) as e:
            engine.shutdown()
            raise SetupError(f"--lora-modules {name}={path}: {e}") from None
    try:
        sampling, gen_suffix = request_sampling_defaults(args, engine.model)
        template, template_suffix = chat_template(args.chat_template, engine)
    except SetupError:
        engine.shutdown()
        raise
    server_config = ServerConfig(
        served_model_names=names,
        sampling_defaults=sampling,
        settings_suffix=gen_suffix + template_suffix,
        chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
        max_num_seqs=settings.get("max_num_seqs", SETTINGS_BY_NAME["max_num_seqs"].default),
        deterministic_by_default=args.deterministic_by_default,
        default_seed=args.default_seed,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser or default_reasoning_parser(engine.model),
        **config,
    )
    try:
        return build_app(engine, server_config)
    except ValueError as e:  # a setting the model cannot have (a parser's tags)
        engine.shutdown()
        raise SetupError(str(e)) from None


def default_reasoning_parser(model_dir: str) -> str | None:
    """The reasoning parser a model gets without ``--reasoning-parser``: gpt-oss always
    answers in its Harmony format, which is read as vLLM reads it (``openai_gptoss``)."""
    import json

    from detspec.server.harmony import NAME

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("model_type") != "gpt_oss":
        return None
    logging.getLogger("detspec.server").info(
        "gpt-oss answers in Harmony: its reasoning, answer and calls are read by the %s "
        "reasoning parser",
        NAME,
    )
    return NAME


def chat_template(spec: str | None, engine: Any) -> tuple[str | None, str]:
    """``--chat-template``'s source (a file's text, or the flag's value when it is a template
    itself, as vLLM reads it), compiled once by the engine, and its fingerprint suffix;
    ``SetupError`` for a missing file or a template that does not compile."""
    import hashlib

    from detspec.errors import DetspecError

    if spec is None:
        return None, ""
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            source = f.read()
    elif "{{" in spec or "{%" in spec:
        source = spec
    else:
        raise SetupError(f"--chat-template {spec}: no such file (and not a Jinja template)")
    tokenizer = engine.get_tokenizer()
    if tokenizer is None:
        raise SetupError("--chat-template: the model has no tokenizer")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=source)
    except DetspecError as e:
        if "invalid chat template" in str(e):  # a render error can be the template's rule
            raise SetupError(f"--chat-template: {e}") from None
    return source, "+tmpl" + hashlib.sha256(source.encode()).hexdigest()[:8]


def request_sampling_defaults(
    args: argparse.Namespace, model_dir: str
) -> tuple[dict[str, float | int], str]:
    """``--generation-config`` / ``--override-generation-config``'s request defaults, checked
    by the engine's rules, and their fingerprint suffix; ``SetupError`` naming the flag."""
    import json

    from detspec.server import generation_config as G

    override = None
    if args.override_generation_config is not None:
        try:
            override = json.loads(args.override_generation_config)
        except ValueError as e:
            raise SetupError(f"--override-generation-config: not valid JSON: {e}") from None
        if not isinstance(override, dict):
            raise SetupError("--override-generation-config: expected a JSON object")
    try:
        defaults = G.sampling_defaults(args.generation_config, model_dir, override)
        G.check(defaults)
    except G.GenerationConfigError as e:
        raise SetupError(str(e)) from None
    if defaults:
        logging.getLogger("detspec.server").info(
            "requests that leave these unset get the generation config's %s "
            "(--generation-config vllm for none)",
            defaults,
        )
    # The model's fingerprint covers its own generation_config.json; other defaults are named.
    own = defaults
    if args.generation_config != "auto" or override:
        try:
            own = G.sampling_defaults("auto", model_dir)
        except G.GenerationConfigError:
            own = {}
    return defaults, G.fingerprint_suffix(defaults, own)


def cors_settings(args: argparse.Namespace) -> Any:
    """``--allowed-origins`` and its companions, or None (no CORS headers) without it."""
    from detspec.server.serving import CorsSettings

    if args.allowed_origins is None:
        return None
    return CorsSettings(
        allow_origins=args.allowed_origins,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
    )


def serve(args: argparse.Namespace) -> int:
    missing = missing_extra("serve")
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1

    import uvicorn

    api_key = args.api_key or os.environ.get("DETSPEC_API_KEY") or None
    if args.host not in _LOOPBACK and api_key is None:
        print(
            f"warning: binding {args.host} without an API key: anyone who can reach this port "
            "can use the server (set --api-key or DETSPEC_API_KEY)",
            file=sys.stderr,
        )
    try:
        app = build_from_args(
            args,
            api_key=api_key,
            max_waiting_requests=args.max_waiting_requests,
            max_request_bytes=args.max_request_bytes,
            cors=cors_settings(args),
            request_id_headers=args.enable_request_id_headers,
            max_stored_responses=args.max_stored_responses,
        )
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    state = app.state.server
    engine = state.engine
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=5,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        root_path=args.root_path or "",
    )
    server = _Server(uv_config, state)
    logging.getLogger("detspec.server").info(
        "serving %s as %s on %s://%s:%d",
        engine.model,
        state.model_names,
        "https" if args.ssl_certfile else "http",
        args.host,
        args.port,
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
