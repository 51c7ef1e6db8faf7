"""A tool-calling loop with the ``openai`` client against ``detspec serve``.

The agent loop every tool-use harness runs: send the conversation and the tools, run the calls
the model makes, append the results as ``tool`` messages, repeat until the model answers in
text. With ``"deterministic": true`` and a seed, every turn is bit-for-bit reproducible, tool
call ids included: ``--check-replay`` runs the loop twice and compares the transcripts.

    python examples/tool_loop_http.py                 # starts its own server (a tiny model)
    python examples/tool_loop_http.py --url http://127.0.0.1:8000 --model m --no-arrange

Without a URL it builds a tiny random model whose chat template renders tools Hermes-style
(Qwen2/Qwen3) and serves it with ``--enable-auto-tool-choice --tool-call-parser hermes``.
A random model never decides to call a tool, so by default each turn is *arranged*: turn 1
carries a regex (vLLM's ``structured_outputs``) that spells the call, the last turn one that
spells the answer. Against a real instruction-tuned model, pass ``--no-arrange``.

Needs ``pip install '.[serve]' openai``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

HERMES_TEMPLATE = (
    "{% if tools %}<s>system\nYou may call these tools:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n"
    "{% if m['tool_calls'] %}"
    "{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n"
    "</tool_call>\n{% endfor %}"
    "{% elif m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>\n"
    "{% else %}{{ m['content'] | trim }}\n{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def get_weather(city: str) -> dict[str, Any]:
    return {"city": city, "sky": "sunny", "celsius": 21}


FUNCTIONS = {"get_weather": get_weather}

# The arranged turns (a random model's output, steered by a regex).
CALL_RE = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
ANSWER_RE = r"It is sunny in Paris \(21 C\)\."


def tiny_model(dir_: Path) -> str:
    import detspec

    detspec._core.write_demo_model(str(dir_), "tiny", 5)
    cfg_path = dir_ / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(dir_)


@contextlib.contextmanager
def server(model_dir: str) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "detspec", "serve", model_dir, "--port", str(port),
           "--served-model-name", "tiny", "--max-model-len", "1024",
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"detspec serve exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait()


def run_loop(client: openai.OpenAI, model: str, arrange: bool, max_turns: int = 4) -> list[dict]:
    """The agent loop; returns the transcript."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    for turn in range(max_turns):
        extra: dict[str, Any] = {"deterministic": True}
        if arrange:
            extra["structured_outputs"] = {"regex": CALL_RE if turn == 0 else ANSWER_RE}
        r = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            temperature=0.7,
            seed=1234,
            max_tokens=200,
            extra_body=extra,
        )
        choice = r.choices[0]
        msg = choice.message
        keep = {"role", "content", "tool_calls"}
        messages.append(msg.model_dump(exclude_none=True, include=keep))
        print(f"turn {turn}: finish_reason={choice.finish_reason}")
        if choice.finish_reason != "tool_calls":
            print(f"  assistant: {msg.content}")
            break
        for call in msg.tool_calls or []:
            args = json.loads(call.function.arguments)
            result = FUNCTIONS[call.function.name](**args)
            print(f"  call {call.id}: {call.function.name}({args}) -> {result}")
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
            )
    return messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running detspec serve (default: start one)")
    ap.add_argument("--model", default="tiny", help="served model name")
    ap.add_argument("--no-arrange", action="store_true", help="let the model decide")
    ap.add_argument("--check-replay", action="store_true", help="run twice, compare")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            url = stack.enter_context(server(tiny_model(tmp / "model")))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        first = run_loop(client, args.model, not args.no_arrange)
        if args.check_replay:
            again = run_loop(client, args.model, not args.no_arrange)
            if again != first:
                raise SystemExit("replay differs")
            print("replay: identical transcript (tool call ids included)")


if __name__ == "__main__":
    main()
