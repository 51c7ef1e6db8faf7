"""``detspec serve`` as a process: SIGINT/SIGTERM end it gracefully with exit status 0 (also
mid-stream), it says what to install without the ``serve`` extra, ``import detspec`` stays
free of the server stack, and ``detspec bench serve`` runs against it."""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from server_fixtures import SERVED_NAME, demo_model_dir, server, start_server  # noqa: F401


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_exits_zero_mid_stream(tmp_path_factory, demo_model_dir, sig) -> None:
    s = start_server(tmp_path_factory, f"sig{int(sig)}", demo_model_dir, "--shutdown-timeout", "2")
    got: dict = {}

    def stream() -> None:
        body = {
            "model": SERVED_NAME,
            "prompt": "Hello",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", s.base_url + "/v1/completions", json=body, timeout=60) as r:
                got["status"] = r.status_code
                got["lines"] = [line for line in r.iter_lines() if line]
        except httpx.HTTPError as e:  # the server may cut the stream at its deadline
            got["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    # wait until the request is streaming
    for _ in range(200):
        if s.metric("detspec:generation_tokens_total") > 0:
            break
        threading.Event().wait(0.05)
    rc = s.stop(sig, timeout=30)
    t.join(30)
    assert rc == 0, f"exit status {rc}:\n{s.log()}"
    assert got.get("status") == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.base_url + "/health", timeout=2)


def test_idle_sigint_exits_zero(tmp_path_factory, demo_model_dir) -> None:
    s = start_server(tmp_path_factory, "idle", demo_model_dir)
    assert httpx.get(s.base_url + "/health").status_code == 200
    assert s.stop(signal.SIGINT) == 0, s.log()


def _run_py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_serve_without_extra_says_what_to_install() -> None:
    r = _run_py(
        "import sys; sys.modules['fastapi'] = None\n"
        "from detspec.cli import main\n"
        "sys.exit(main(['serve']))"
    )
    assert r.returncode == 1, r.stderr
    assert "pip install 'detspec[serve]'" in r.stderr


def test_import_detspec_stays_light() -> None:
    r = _run_py(
        "import sys, detspec, detspec.cli, detspec.server, detspec.server.serve\n"
        "heavy = [m for m in ('fastapi', 'uvicorn', 'prometheus_client', 'httpx', 'openai')"
        " if m in sys.modules]\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)"
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_non_loopback_without_key_warns() -> None:
    # the model dir does not exist, so it stops right after the warning without binding
    r = subprocess.run(
        [sys.executable, "-m", "detspec", "serve", "/nonexistent-model", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "warning: binding 0.0.0.0 without an API key" in r.stderr
    assert "nonexistent-model" in r.stderr


def test_bench_serve(server, tmp_path) -> None:
    out = tmp_path / "bench.json"
    # Inter-token latencies need a stream of two chunks or more. A fast machine can finish a
    # short output before the engine's dispatcher first wakes, and then sends each stream as
    # one chunk (coalescing is correct; the ITL is then NaN): rerun while no stream was split.
    for _ in range(4):
        r = subprocess.run(
            [
                sys.executable, "-m", "detspec", "bench", "serve",
                "--base-url", server.base_url,
                "--num-prompts", "12", "--max-concurrency", "4",
                "--random-input-len", "16", "--random-output-len", "8",
                "--deterministic-fraction", "0.5", "--result-file", str(out),
            ],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(out.read_text())
        if not math.isnan(res["p90_itl_ms"]):
            break
    assert res["completed"] == 12 and res["failed"] == 0
    assert res["total_output_tokens"] == 12 * 8
    for key in ("request_throughput", "output_throughput", "p99_ttft_ms", "p50_tpot_ms",
                "p90_itl_ms", "p99_e2el_ms"):  # fmt: skip
        assert res[key] > 0, key
    # Poisson arrivals
    r = subprocess.run(
        [
            sys.executable, "-m", "detspec", "bench", "serve",
            "--base-url", server.base_url, "--num-prompts", "6", "--request-rate", "20",
            "--random-input-len", "8", "--random-output-len", "4", "--endpoint", "chat",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["completed"] == 6


def test_bench_given_lengths_and_inprocess(server, demo_model_dir, tmp_path) -> None:
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([[8, 3], [4, 5]]))
    common = ["--num-prompts", "4", "--lengths-file", str(lengths), "--max-concurrency", "2"]
    http = subprocess.run(
        [sys.executable, "-m", "detspec", "bench", "serve", "--base-url", server.base_url,
         *common],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert http.returncode == 0, http.stdout + http.stderr
    inproc = subprocess.run(
        [sys.executable, "-m", "detspec", "bench", "serve", "--backend", "inprocess",
         "--model-dir", demo_model_dir, "--vocab-size", "256", *common],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert inproc.returncode == 0, inproc.stdout + inproc.stderr
    for out in (json.loads(http.stdout), json.loads(inproc.stdout)):
        assert out["completed"] == 4
        assert out["total_input_tokens"] == 8 + 4 + 8 + 4
        assert out["total_output_tokens"] == 3 + 5 + 3 + 5
