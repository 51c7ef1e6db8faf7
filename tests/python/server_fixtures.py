"""Helpers and fixtures for the server tests: a real ``detspec serve`` subprocess on a free
loopback port, serving the tiny demo model (random weights, built locally).

Test modules import the fixtures they use from here (``from server_fixtures import ...``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

SERVED_NAME = "tiny"
API_KEY = "sk-test-" + "k" * 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A ``python -m detspec serve`` subprocess; its log goes to a file (shown on failure)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        ca_file: str | None = None,
    ):
        """``ca_file``: the server speaks HTTPS with a certificate this CA signed."""
        self.port = free_port()
        self.verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=ca_file) if ca_file else True
        )
        self.base_url = f"{'https' if ca_file else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "detspec",
            "serve",
            *args,
            "--port",
            str(self.port),
            "--served-model-name",
            SERVED_NAME,
            "--disable-uvicorn-access-log",
            "--uvicorn-log-level",
            "warning",
        ]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self._wait_ready()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.base_url + "/health", timeout=1.0, verify=self.verify)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not become ready in {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {series (with labels): value}."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        """The value of an unlabelled-by-reason series (``model_name`` label only)."""
        for k, v in self.metrics().items():
            if re.fullmatch(rf"{re.escape(name)}(\{{[^}}]*\}})?", k):
                return v
        raise KeyError(name)

    def wait_kv_idle(self, timeout: float = 20.0) -> float:
        """Waits until no KV page is held by a request; returns the final used count."""
        deadline = time.monotonic() + timeout
        used = -1.0
        while time.monotonic() < deadline:
            used = self.metric("detspec:kv_cache_used_pages")
            running = self.metric("detspec:num_requests_running")
            if used == 0 and running == 0:
                return used
            time.sleep(0.1)
        return used


def start_server(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str, **kw):
    log = tmp_path_factory.mktemp(f"server-{name}") / "server.log"
    return ServerProcess(list(args), log, **kw)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny demo model with seed 5 (flat next-token distributions: batch variance of the
    fast path shows up in logprobs)."""
    import detspec

    d = tmp_path_factory.mktemp("serve-model")
    detspec._core.write_demo_model(str(d), "tiny", 5)
    return str(d)


@pytest.fixture(scope="session")
def server(tmp_path_factory, demo_model_dir) -> Iterator[ServerProcess]:
    """A plain server (no key) whose DVR replays: small verify window and group so that
    verify passes and rollbacks happen in short outputs."""
    s = start_server(
        tmp_path_factory,
        "main",
        demo_model_dir,
        "--max-model-len",
        "256",
        "--verify-strategy",
        "replay",
        "--verify-window",
        "8",
        "--verify-group",
        "4",
        "--num-kv-pages",
        "1024",
    )
    yield s
    rc = s.stop()
    assert rc == 0, f"server exited with {rc}:\n{s.log()}"


@pytest.fixture(scope="session")
def inline_server(tmp_path_factory, demo_model_dir) -> Iterator[ServerProcess]:
    """A server with the engine's default DVR strategy (inline on CPU)."""
    s = start_server(
        tmp_path_factory,
        "inline",
        demo_model_dir,
        "--max-model-len",
        "256",
        "--num-kv-pages",
        "1024",
    )
    yield s
    rc = s.stop()
    assert rc == 0, f"server exited with {rc}:\n{s.log()}"


@pytest.fixture(scope="session")
def guarded_server(tmp_path_factory, demo_model_dir) -> Iterator[ServerProcess]:
    """API key, a 64 KiB body limit, one running sequence and no waiting room."""
    s = start_server(
        tmp_path_factory,
        "guarded",
        demo_model_dir,
        "--max-model-len",
        "2048",
        "--api-key",
        API_KEY,
        "--max-request-bytes",
        str(64 * 1024),
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "0",
        "--num-kv-pages",
        "256",
    )
    yield s
    rc = s.stop()
    assert rc == 0, f"server exited with {rc}:\n{s.log()}"


def sse_events(resp: httpx.Response) -> list[dict | str]:
    """The ``data:`` payloads of an SSE response (``"[DONE]"`` as a string)."""
    out: list[dict | str] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# A Hermes-style chat template (written for the tests): renders the tools, earlier calls and
# `tool` messages, as the hermes tool-call parser reads them back.
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


# The tools' parameters in the tool tests (chat's and the Responses API's).
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="session")
def tool_model_dir(demo_model_dir, tmp_path_factory) -> str:
    d = Path(tmp_path_factory.mktemp("tool-model")) / "m"
    shutil.copytree(demo_model_dir, d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="session")
def tool_server(tmp_path_factory, tool_model_dir) -> Iterator[ServerProcess]:
    """The Hermes template and tool parser (tools default to ``auto``); DVR that verifies
    and rolls back within short outputs. Chat's tool tests and the Responses API's share it."""
    s = start_server(
        tmp_path_factory,
        "tools",
        tool_model_dir,
        "--max-model-len",
        "1024",
        "--verify-strategy",
        "replay",
        "--verify-window",
        "8",
        "--verify-group",
        "4",
        "--num-kv-pages",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield s
    assert s.stop() == 0, s.log()


# The demo model ("tiny"): hidden 128, 4 heads of 32 (2 for K/V), MLP 344, 4 layers.
SHAPES = {
    "self_attn.q_proj": (128, 128),
    "self_attn.k_proj": (128, 64),
    "self_attn.v_proj": (128, 64),
    "self_attn.o_proj": (128, 128),
    "mlp.gate_proj": (128, 344),
    "mlp.up_proj": (128, 344),
    "mlp.down_proj": (344, 128),
}


def write_adapter(root: Path, name: str, seed: int, modules: tuple[str, ...] = tuple(SHAPES)):
    """A PEFT LoRA directory for the demo model: rank 8, random A and B on ``modules``."""
    rng = np.random.default_rng(seed)
    d = root / name
    d.mkdir()
    tensors = {}
    for layer in range(4):
        for m in modules:
            din, dout = SHAPES[m]
            p = f"base_model.model.model.layers.{layer}.{m}"
            tensors[f"{p}.lora_A.weight"] = (rng.standard_normal((8, din)) * 0.1).astype("f4")
            tensors[f"{p}.lora_B.weight"] = (rng.standard_normal((dout, 8)) * 0.1).astype("f4")
    save_file(tensors, str(d / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": [m.split(".")[1] for m in modules],
        "bias": "none",
    }
    (d / "adapter_config.json").write_text(json.dumps(config))
    return str(d)
