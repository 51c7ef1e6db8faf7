"""``vllm serve`` launch lines run as ``detspec serve``: CORS (``--allowed-origins`` and its
companions), ``--enable-request-id-headers``, HTTPS (``--ssl-keyfile`` / ``--ssl-certfile``),
``--root-path``, ``--gpu-memory-utilization`` (no effect on the CPU), and the flags detspec
has one answer to (``-tp 1``, ``--trust-remote-code``);
a parallel size above 1 stops the server with an error naming the flag."""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trustme
from server_fixtures import (  # noqa: F401
    API_KEY,
    SERVED_NAME,
    ServerProcess,
    demo_model_dir,
    start_server,
)

UI = "https://ui.example"
CHAT = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def browser_server(tmp_path_factory, demo_model_dir) -> Iterator[ServerProcess]:
    s = start_server(
        tmp_path_factory,
        "launch",
        demo_model_dir,
        "--max-model-len",
        "128",
        "--num-kv-pages",
        "128",
        "--api-key",
        API_KEY,
        "--allowed-origins",
        f'["{UI}"]',
        "--enable-request-id-headers",
        "-tp",
        "1",
        "--trust-remote-code",
        "--gpu-memory-utilization",
        "0.9",
    )
    yield s
    assert s.stop() == 0, s.log()


def test_cors_preflight_passes_the_key_guard_for_allowed_origins_only(browser_server) -> None:
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    url = f"{browser_server.base_url}/v1/chat/completions"
    ok = httpx.options(url, headers={"Origin": UI, **preflight}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == UI
    evil = httpx.options(url, headers={"Origin": "https://evil.example", **preflight}, timeout=30)
    assert "access-control-allow-origin" not in evil.headers
    # The request itself still needs the key, and carries the header for the browser.
    r = httpx.post(url, json=CHAT, headers={"Origin": UI, **AUTH}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    assert httpx.post(url, json=CHAT, headers={"Origin": UI}, timeout=30).status_code == 401


def test_request_id_header_is_echoed_or_made(browser_server) -> None:
    url = f"{browser_server.base_url}/v1/chat/completions"
    r = httpx.post(url, json=CHAT, headers={"X-Request-Id": "trace-17", **AUTH}, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-17"
    made = httpx.get(f"{browser_server.base_url}/health", timeout=30).headers["x-request-id"]
    other = httpx.get(f"{browser_server.base_url}/health", timeout=30).headers["x-request-id"]
    assert len(made) == 32 and made != other
    # Errors carry it too (the guard answers before the app).
    r = httpx.post(url, json=CHAT, headers={"X-Request-Id": "trace-18"}, timeout=30)
    assert r.status_code == 401 and r.headers["x-request-id"] == "trace-18"


def test_https_and_root_path(tmp_path_factory, demo_model_dir) -> None:
    d = Path(tmp_path_factory.mktemp("tls"))
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    s = ServerProcess(
        [
            demo_model_dir,
            "--max-model-len",
            "128",
            "--num-kv-pages",
            "64",
            "--ssl-keyfile",
            str(d / "key.pem"),
            "--ssl-certfile",
            str(d / "cert.pem"),
            "--root-path",
            "/llm",
        ],
        d / "server.log",
        ca_file=str(d / "ca.pem"),
    )
    try:
        client = openai.OpenAI(
            base_url=f"{s.base_url}/v1",
            api_key="none",
            max_retries=0,
            http_client=httpx.Client(verify=s.verify),
        )
        r = client.chat.completions.create(**CHAT)
        assert r.usage.completion_tokens == 2
        # The OpenAPI document names the prefix the proxy serves it under.
        spec = httpx.get(f"{s.base_url}/openapi.json", verify=s.verify).json()
        assert spec["servers"] == [{"url": "/llm"}]
        # Plain HTTP is not spoken there.
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.base_url.replace("https", "http") + "/health", timeout=5)
    finally:
        assert s.stop() == 0, s.log()


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "-pp", "--data-parallel-size"])
def test_parallel_sizes_above_one_stop_the_server_naming_the_flag(
    tmp_path: Path, demo_model_dir, flag
) -> None:
    with pytest.raises(RuntimeError, match="parallel-size 2: an engine runs on one device"):
        ServerProcess([demo_model_dir, flag, "2"], tmp_path / "server.log")
