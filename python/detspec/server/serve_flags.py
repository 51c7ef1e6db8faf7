"""The flags of ``detspec serve`` (``add_serve_arguments``: the HTTP server's, then
``add_app_arguments``') and of ``detspec run-batch`` (``add_app_arguments``: the model, the
request handling, the engine's settings from ``detspec.engine_args``), with ``vllm serve``'s
names where one exists. ``serve`` turns them into the engine, the app and the HTTP server.
"""

from __future__ import annotations

import argparse

from detspec.engine_args import add_engine_arguments
from detspec.server.reasoning import PARSERS as REASONING_PARSERS
from detspec.server.tool_parsers import PARSERS


def add_app_arguments(p: argparse.ArgumentParser) -> None:
    """What the request handling needs, for ``serve`` and ``run-batch``: the model, the
    served names, server-wide determinism, the output parsers and the engine's flags (from
    ``detspec.engine_args.ENGINE_SETTINGS``); ``vllm serve``'s names where one exists."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory (default: the built-in default model, detspec-tiny-en)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the model directory's name)",
    )
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
    # What vLLM launch lines carry that detspec has one answer to (accepted so those lines run).
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="1 only: one engine runs on one device (scale out with Ray replicas, docs/scaling.md)",
    )
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="1 only (Ray replicas)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's launch lines: detspec never runs a model's own Python code",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="{auto,vllm,DIR}",
        help="request defaults for the sampling fields a request leaves unset: auto (the "
        "model's generation_config.json, as vLLM), vllm (none: OpenAI's defaults) or a "
        "directory holding a generation_config.json",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="laid over the generation config, e.g. '{\"temperature\": 0.5}'",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="the chat template (a file, or the template itself) instead of the model's; "
        "named in the fingerprint (+tmpl<hash>)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="honour a request's `chat_template` (without it such a request is a 400)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='read tool calls from the output of tool_choice "auto" requests (with '
        "--tool-call-parser); without it such a request is a 400",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="the model's tool-call format: hermes (<tool_call> JSON: Qwen2/Qwen3, Hermes), "
        "llama3_json (Llama 3.1+ JSON calls), mistral ([TOOL_CALLS]), glm45 / glm47 "
        "(GLM-4.5/4.6/4.7's <arg_key>/<arg_value> calls), qwen3_coder / qwen3_xml (Qwen3-Coder's "
        "<function=...><parameter=...> calls), deepseek_v3 / deepseek_v31 (DeepSeek's "
        "<｜tool▁call▁begin｜> calls), kimi_k2 (Kimi K2's, ids kept), minimax_m2 (MiniMax-M2's "
        "<invoke name=...> calls), pythonic / llama4_pythonic (a Python list of calls: Llama "
        "3.2/4, ToolACE), lfm2 (LFM2's <|tool_call_start|>[...] lists), openai (gpt-oss's "
        "Harmony calls; with "
        "--reasoning-parser openai_gptoss)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="a thinking model's format: deepseek_r1 (DeepSeek-R1 and distills, QwQ), qwen3, "
        "glm45, deepseek_v3 (V3.1: thinking by chat_template_kwargs thinking=true), kimi_k2 "
        "(Kimi K2 Thinking; a tool-call section ends the thinking too), minimax_m2 "
        "(and minimax_m2_append_think: the thinking kept in the content, <think> included), "
        "openai_gptoss (gpt-oss's Harmony; the default for a gpt-oss checkpoint); chat answers "
        "then carry `reasoning` (and `reasoning_content`) beside `content`, and output "
        "constraints apply after the thinking",
    )
    p.add_argument(
        "--lora-modules",
        "--lora-paths",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to load at start-up, each served under its "
        'NAME as a model (`name=path`, or vLLM\'s JSON {"name": ..., "path": ...}); needs '
        "--enable-lora (more at run time: POST /v1/load_lora_adapter)",
    )
    add_engine_arguments(p)


def _json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's format for the CORS flags)."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``detspec serve``'s flags: the HTTP server's, then ``add_app_arguments``'."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes (or set DETSPEC_API_KEY)",
    )
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
    p.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=None,
        metavar="JSON",
        help="origins browsers may call from, e.g. '[\"https://ui.example\"]' (CORS; "
        "without it no CORS headers are sent, unlike vLLM's allow-all default)",
    )
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON")
    p.add_argument("--allow-credentials", action="store_true")
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=1024,
        help="Responses API answers kept in memory for previous_response_id and GET "
        "/v1/responses/{id} (least recently used dropped beyond it; 0: none)",
    )
    p.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries X-Request-Id (the client's, where it sent one)",
    )
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key")
    p.add_argument("--ssl-certfile", default=None, help="... and this certificate")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates for client certificates")
    p.add_argument(
        "--root-path", default=None, help="the path prefix a proxy serves this server under"
    )
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    add_app_arguments(p)
