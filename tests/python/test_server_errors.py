"""Bad input over HTTP: each case gets its status and an OpenAI error body whose message names
the parameter; afterwards a normal request succeeds and no KV page is held. Also: API key
(401), body limit (413), waiting-queue limit (503 + Retry-After), unknown model (404) and a
client that disconnects mid-stream (its request is aborted, its pages come back)."""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_fixtures import (  # noqa: F401
    API_KEY,
    SERVED_NAME,
    demo_model_dir,
    guarded_server,
    server,
    start_server,
)

OK = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 2}
CHAT_OK = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
LONG = [5] * 300  # max_model_len is 256


def body(base: dict, **over) -> str:
    d = dict(base)
    for k, v in over.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return json.dumps(d)


_DROP = object()

# (id, route, raw JSON body, status, param)
CASES = [
    ("malformed-json", "/v1/completions", '{"prompt": "Hello", ', 400, "body"),
    ("body-not-object", "/v1/completions", "[1, 2]", 400, "body"),
    ("missing-prompt", "/v1/completions", body(OK, prompt=_DROP), 400, "prompt"),
    ("prompt-wrong-type", "/v1/completions", body(OK, prompt=123), 400, "prompt"),
    ("prompt-mixed-list", "/v1/completions", body(OK, prompt=[1, "a"]), 400, "prompt"),
    ("prompt-empty-list", "/v1/completions", body(OK, prompt=[]), 400, "prompt"),
    ("prompt-negative-id", "/v1/completions", body(OK, prompt=[5, -3]), 400, "prompt"),
    ("prompt-id-out-of-vocab", "/v1/completions", body(OK, prompt=[5, 99999]), 400, "prompt"),
    ("prompt-too-long", "/v1/completions", body(OK, prompt=LONG), 400, "prompt"),
    ("text-prompt-too-long", "/v1/completions", body(OK, prompt="fox " * 400), 400, "prompt"),
    ("max-tokens-string", "/v1/completions", body(OK, max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-negative", "/v1/completions", body(OK, max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", "/v1/completions", body(OK, max_tokens=0), 400, "max_tokens"),
    ("max-tokens-huge", "/v1/completions", body(OK, max_tokens=10**12), 400, "max_tokens"),
    ("max-tokens-over-context", "/v1/completions", body(OK, max_tokens=300), 400, "max_tokens"),
    ("temperature-nan", "/v1/completions", body(OK)[:-1] + ', "temperature": NaN}', 400,
     "temperature"),
    ("temperature-inf", "/v1/completions", body(OK)[:-1] + ', "temperature": Infinity}', 400,
     "temperature"),
    ("temperature-negative", "/v1/completions", body(OK, temperature=-1), 400, "temperature"),
    ("temperature-bool", "/v1/completions", body(OK, temperature=True), 400, "temperature"),
    ("top-p-zero", "/v1/completions", body(OK, top_p=0), 400, "top_p"),
    ("top-p-over-one", "/v1/completions", body(OK, top_p=1.5), 400, "top_p"),
    ("top-k-negative", "/v1/completions", body(OK, top_k=-2), 400, "top_k"),
    ("min-p-over-one", "/v1/completions", body(OK, min_p=2), 400, "min_p"),
    ("n-zero", "/v1/completions", body(OK, n=0), 400, "n"),
    ("n-huge", "/v1/completions", body(OK, n=1000), 400, "n"),
    ("presence-penalty", "/v1/completions", body(OK, presence_penalty=3), 400,
     "presence_penalty"),
    ("frequency-penalty-type", "/v1/completions", body(OK, frequency_penalty="high"), 400,
     "frequency_penalty"),
    ("repetition-penalty-zero", "/v1/completions", body(OK, repetition_penalty=0), 400,
     "repetition_penalty"),
    ("logprobs-huge", "/v1/completions", body(OK, logprobs=50), 400, "logprobs"),
    ("logprobs-negative", "/v1/completions", body(OK, logprobs=-1), 400, "logprobs"),
    ("seed-over-int64", "/v1/completions", body(OK, seed=2**70), 400, "seed"),
    ("seed-string", "/v1/completions", body(OK, seed="abc"), 400, "seed"),
    ("stop-wrong-type", "/v1/completions", body(OK, stop=5), 400, "stop"),
    ("stop-empty-string", "/v1/completions", body(OK, stop=[""]), 400, "stop"),
    ("stop-token-negative", "/v1/completions", body(OK, stop_token_ids=[4, -1]), 400,
     "stop_token_ids[1]"),
    ("stop-token-out-of-vocab", "/v1/completions", body(OK, stop_token_ids=[99999]), 400,
     "stop_token_ids"),
    ("min-tokens-over-max", "/v1/completions", body(OK, min_tokens=20, max_tokens=5), 400,
     "min_tokens"),
    ("unknown-field", "/v1/completions", body(OK, frobnicate=1), 400, "frobnicate"),
    ("logit-bias-key", "/v1/completions", body(OK, logit_bias={"five": 10}), 400, "logit_bias"),
    ("logit-bias-value", "/v1/completions", body(OK, logit_bias={"5": 101}), 400, "logit_bias"),
    ("echo-suffix", "/v1/completions", body(OK, echo=True, suffix="x"), 400, "suffix"),
    ("stream-wrong-type", "/v1/completions", body(OK, stream="yes"), 400, "stream"),
    ("stream-options-without-stream", "/v1/completions",
     body(OK, stream_options={"include_usage": True}), 400, "stream_options"),
    ("deterministic-string", "/v1/completions", body(OK, deterministic="true"), 400,
     "deterministic"),
    ("deterministic-sampling-without-seed", "/v1/completions",
     body(OK, deterministic=True, temperature=0.7), 400, "seed"),
    ("prompt-logprobs-huge", "/v1/completions", body(OK, prompt_logprobs=100), 400,
     "prompt_logprobs"),
    ("unknown-model", "/v1/completions", body(OK, model="gpt-4"), 404, "model"),
    ("chat-empty-messages", "/v1/chat/completions", body(CHAT_OK, messages=[]), 400,
     "messages"),
    ("chat-missing-messages", "/v1/chat/completions", body(CHAT_OK, messages=_DROP), 400,
     "messages"),
    ("chat-bad-role", "/v1/chat/completions",
     body(CHAT_OK, messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("chat-content-type", "/v1/chat/completions",
     body(CHAT_OK, messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("chat-top-logprobs-without-logprobs", "/v1/chat/completions",
     body(CHAT_OK, top_logprobs=2), 400, "top_logprobs"),
    ("chat-top-logprobs-huge", "/v1/chat/completions",
     body(CHAT_OK, logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("chat-max-completion-tokens-zero", "/v1/chat/completions",
     body(CHAT_OK, max_completion_tokens=0), 400, "max_completion_tokens"),
    ("chat-too-long", "/v1/chat/completions",
     body(CHAT_OK, messages=[{"role": "user", "content": "fox " * 400}]), 400, "messages"),
    # tools without tool_choice mean "auto", which needs --enable-auto-tool-choice
    ("chat-tools-auto-without-parser", "/v1/chat/completions",
     body(CHAT_OK, tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tool_choice"),
    ("chat-unknown-model", "/v1/chat/completions", body(CHAT_OK, model="nope"), 404, "model"),
    ("detokenize-out-of-vocab", "/detokenize", json.dumps({"tokens": [99999]}), 400, "tokens"),
    ("tokenize-wrong-type", "/tokenize", json.dumps({"prompt": 5}), 400, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "raw", "status", "param"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_input(server, route, raw, status, param) -> None:
    r = httpx.post(
        server.base_url + route,
        content=raw.encode(),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["code"] == status
    assert isinstance(err["type"], str) and err["type"]
    name = param.split("[")[0].split(".")[0]
    assert name in err["message"], err["message"]


def test_battery_size() -> None:
    assert len(CASES) >= 30


def test_unknown_route_and_method(server) -> None:
    r = httpx.get(server.base_url + "/v1/nonexistent")
    assert r.status_code == 404 and "/v1/nonexistent" in r.json()["error"]["message"]
    r = httpx.get(server.base_url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_disconnect_mid_stream_aborts(server) -> None:
    before_tokens = server.metric("detspec:generation_tokens_total")
    payload = json.dumps(
        {
            "model": SERVED_NAME,
            "prompt": "The quick brown fox",
            "max_tokens": 200,
            "n": 16,  # 16 sequences, so 200 steps outlast the hang-up even on a fast machine
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.0,
        }
    ).encode()
    # A raw socket: read the first SSE chunk, then hang up.
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        got = b""
        while b"data: " not in got:
            chunk = s.recv(4096)
            assert chunk, "server closed before streaming"
            got += chunk
        assert b"200 OK" in got
    assert server.wait_kv_idle() == 0, "KV pages still held after the client left"
    time.sleep(0.3)
    produced = server.metric("detspec:generation_tokens_total") - before_tokens
    assert produced < 16 * 200, (
        f"the request ran to completion ({produced} tokens) after disconnect"
    )
    aborted = server.metrics().get(
        f'detspec:request_success_total{{finished_reason="abort",model_name="{SERVED_NAME}"}}', 0
    )
    assert aborted >= 1


def test_disconnect_non_streaming_aborts(server) -> None:
    """A client that hangs up aborts its request. The request arrives at a paused engine,
    which holds it, so it cannot finish before the hang-up however fast the model is (the
    tiny model once ran all 8000 tokens first); held and not aborted, it would run in full
    once generation resumes."""
    before_tokens = server.metric("detspec:generation_tokens_total")
    r = httpx.post(server.base_url + "/pause", json={"mode": "keep"}, timeout=30)
    assert r.status_code == 200, r.text
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.base_url + "/v1/completions",
                json={**OK, "max_tokens": 250, "ignore_eos": True, "n": 32},
                timeout=0.2,
            )
        time.sleep(1.0)  # the server sees the hang-up (an event; 1 s is ample)
    finally:
        assert httpx.post(server.base_url + "/resume", timeout=30).status_code == 200
    assert server.wait_kv_idle() == 0
    time.sleep(0.3)
    produced = server.metric("detspec:generation_tokens_total") - before_tokens
    assert produced < 32 * 250, f"the request ran to completion ({produced} tokens)"


def test_after_the_battery_server_serves_and_no_page_leaks(server) -> None:
    # runs after the cases above (file order): a normal request works, nothing is held
    r = httpx.post(server.base_url + "/v1/completions", json=OK, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    r = httpx.post(server.base_url + "/v1/chat/completions", json=CHAT_OK, timeout=30)
    assert r.status_code == 200
    assert server.wait_kv_idle() == 0
    assert server.metric("detspec:num_requests_waiting") == 0
    assert server.metrics()[
        f'detspec:request_errors_total{{model_name="{SERVED_NAME}",status="400"}}'
    ] >= sum(1 for c in CASES if c[3] == 400)
    assert httpx.get(server.base_url + "/health").status_code == 200


# --------------------------------------------------------------------------- guarded server


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "headers",
    [{}, auth("wrong"), auth(API_KEY[:-1]), auth(API_KEY + "x"), {"Authorization": API_KEY}],
    ids=["missing", "wrong", "prefix", "longer", "no-bearer"],
)
def test_api_key_required(guarded_server, headers) -> None:
    for route in ("/v1/completions", "/v1/models"):
        r = httpx.request(
            "POST" if route == "/v1/completions" else "GET",
            guarded_server.base_url + route,
            json=OK,
            headers=headers,
        )
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["param"] == "Authorization" and "Authorization" in err["message"]
        assert err["type"] == "authentication_error"


def test_api_key_accepted_and_open_routes(guarded_server) -> None:
    r = httpx.post(guarded_server.base_url + "/v1/completions", json=OK, headers=auth())
    assert r.status_code == 200, r.text
    assert httpx.get(guarded_server.base_url + "/health").status_code == 200
    assert httpx.get(guarded_server.base_url + "/metrics").status_code == 200


def test_body_over_limit(guarded_server) -> None:
    big = {**OK, "prompt": "x" * (70 * 1024)}
    r = httpx.post(guarded_server.base_url + "/v1/completions", json=big, headers=auth())
    assert r.status_code == 413
    assert r.json()["error"]["param"] == "body" and "max-request-bytes" in r.text

    def chunks():  # no Content-Length: the server counts as it reads
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    r = httpx.post(guarded_server.base_url + "/v1/completions", content=chunks(), headers=auth())
    assert r.status_code == 413
    # under the limit, chunked, is fine
    small = json.dumps(OK).encode()
    r = httpx.post(
        guarded_server.base_url + "/v1/completions",
        content=iter([small[:10], small[10:]]),
        headers={**auth(), "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text


def test_waiting_queue_full_is_503(guarded_server) -> None:
    # max_num_seqs=1 and max_waiting_requests=0: while one request runs, the next is refused.
    long = {**OK, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=guarded_server.base_url, headers=auth(), timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=long) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # keep it: a discarded iterator closes the connection
            next(lines)
            r = c.post("/v1/completions", json=OK)
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "1"
            assert "max-waiting-requests" in r.json()["error"]["message"]
            assert guarded_server.metric("detspec:num_requests_running") == 1
            # a single request that would itself leave a sequence waiting
            r = c.post("/v1/completions", json={**OK, "n": 2})
            assert r.status_code == 503
    assert guarded_server.wait_kv_idle() == 0
    r = httpx.post(guarded_server.base_url + "/v1/completions", json=OK, headers=auth())
    assert r.status_code == 200


def test_deterministic_refused_when_the_server_runs_determinism_off(
    tmp_path_factory, demo_model_dir
) -> None:
    s = start_server(tmp_path_factory, "off", demo_model_dir, "--determinism", "off")
    try:
        r = httpx.post(s.base_url + "/v1/completions", json={**OK, "deterministic": True})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "deterministic" and "determinism" in err["message"]
        r = httpx.post(s.base_url + "/v1/completions", json=OK)
        assert r.status_code == 200
        assert "-off" in r.json()["system_fingerprint"]
    finally:
        assert s.stop() == 0, s.log()
