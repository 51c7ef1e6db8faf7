"""The admin and compatibility routes vLLM's and SGLang's clients call, against real servers
over loopback HTTP (a ``detspec serve`` subprocess; uvicorn in this process where a test needs
the server's state):

* ``GET /v1/models/{model}`` through the ``openai`` client's ``models.retrieve``: the listing's
  card, base model and LoRA adapter alike; an unknown name is a 404 naming it;
* ``/ping`` answers as ``/health`` (503 while draining); ``/health_generate`` runs a real
  one-token generation (the engine steps; a stopped engine fails it while ``/health`` still
  passes) and changes no concurrent deterministic request's bits;
* ``/get_model_info`` and ``/get_server_info``: SGLang's fields, the server's settings, never
  the API key;
* ``/abort_request``: a running ``/generate`` aborted by rid ends with ``{"type": "abort"}``
  and fewer tokens than asked while a concurrent request finishes as it would alone; an abort
  that comes before the request reaches the engine still lands; ``abort_all`` ends every
  route's requests and the server serves on; an unknown rid changes nothing.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from server_fixtures import (  # noqa: F401
    API_KEY,
    SERVED_NAME,
    ServerProcess,
    demo_model_dir,
    free_port,
    start_server,
    write_adapter,
)

import detspec
from detspec.async_llm import AsyncLLM
from detspec.server.app import ServerConfig, build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 17, 300, 42, 9, 77, 123]
LONG = 1900  # near the context (2048): seconds of work for the tiny model
MAX_NUM_SEQS = 64
MAX_WAITING = 500


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> str:
    return write_adapter(tmp_path_factory.mktemp("admin-lora"), "ad", seed=3)


@pytest.fixture(scope="module")
def srv(tmp_path_factory, demo_model_dir, adapter_dir) -> Iterator[ServerProcess]:
    """An API key, a LoRA adapter, server-wide determinism and a context long enough for a
    generation that runs while it is aborted."""
    s = start_server(
        tmp_path_factory,
        "admin",
        demo_model_dir,
        "--max-model-len", "2048",
        "--num-kv-pages", "2048",
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-waiting-requests", str(MAX_WAITING),
        "--api-key", API_KEY,
        "--enable-lora",
        "--lora-modules", f"ad={adapter_dir}",
        "--deterministic-by-default",
        "--default-seed", "3",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)


@contextlib.contextmanager
def inprocess_server(model_dir: str) -> Iterator[tuple[str, FastAPI]]:
    """``build_app`` under uvicorn in a thread of this process (real HTTP over loopback), so
    that a test can reach the server's state: drain it, stop its engine."""
    engine = AsyncLLM(model_dir, max_model_len=256, num_kv_pages=256)
    app = build_app(engine, ServerConfig(served_model_names=[SERVED_NAME]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(60)
        engine.shutdown()


def gen_body(rid: str, max_new_tokens: int, **kw: Any) -> dict[str, Any]:
    sp = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0.8}
    return {"input_ids": PROMPT, "rid": rid, "sampling_params": sp, **kw}


async def abort(c: httpx.AsyncClient, **body: Any) -> list[str]:
    r = await c.post("/abort_request", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    return r.json()["rids"]


async def abort_once_running(c: httpx.AsyncClient, rid: str, timeout: float = 30) -> None:
    """Aborts ``rid`` as soon as the server has it (an unknown rid is a no-op, so retrying is
    safe: slime aborts the same way)."""
    deadline = time.monotonic() + timeout
    while not await abort(c, rid=rid):
        assert time.monotonic() < deadline, f"{rid} never showed up"
        await asyncio.sleep(0.005)


async def first_event_then(stream: Any) -> tuple[Any, list[dict]]:
    """Opens an SSE response; returns its line iterator and the first ``data:`` event."""
    lines = stream.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            return lines, [json.loads(line[6:])]
    raise AssertionError("the stream ended before its first event")


async def rest_of(lines: Any, events: list[dict]) -> list[dict]:
    async for line in lines:
        if line.startswith("data: ") and line[6:] != "[DONE]":
            events.append(json.loads(line[6:]))
    return events


# --------------------------------------------------------------------------- models


def test_models_retrieve_returns_the_listings_card(srv, client) -> None:
    listing = client.models.list().data
    assert [m.id for m in listing] == [SERVED_NAME, "ad"]
    for m in listing:
        assert client.models.retrieve(m.id).model_dump() == m.model_dump()
    base, lora = (client.models.retrieve(n) for n in (SERVED_NAME, "ad"))
    assert lora.model_extra["parent"] == SERVED_NAME and base.model_extra["parent"] is None
    assert lora.model_extra["fingerprint"] != base.model_extra["fingerprint"]
    assert base.model_extra["max_model_len"] == 2048
    assert base.model_extra["deterministic_by_default"] is True
    assert base.model_extra["default_seed"] == 3
    assert base.model_extra["fingerprint"].endswith("+det-default-seed3")


@pytest.mark.parametrize("name", ["nope", "org/nope"])
def test_models_retrieve_unknown_is_a_404_naming_it(srv, client, name) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve(name)
    err = e.value.body
    assert isinstance(err, dict), err
    assert f"`{name}`" in err["message"] and SERVED_NAME in err["message"]
    assert (err["type"], err["param"], err["code"]) == ("not_found_error", "model", 404)
    # Over plain HTTP too (a name with a slash is a model name, not another route).
    r = httpx.get(f"{srv.base_url}/v1/models/{name}", headers=AUTH)
    assert r.status_code == 404 and f"`{name}`" in r.json()["error"]["message"]


def test_models_retrieve_needs_the_key(srv) -> None:
    r = httpx.get(f"{srv.base_url}/v1/models/{SERVED_NAME}")
    assert r.status_code == 401, r.text


# --------------------------------------------------------------------------- health


def test_ping_answers_as_health_and_needs_no_key(srv) -> None:
    assert httpx.get(srv.base_url + "/health").status_code == 200
    assert httpx.get(srv.base_url + "/ping").status_code == 200
    assert httpx.post(srv.base_url + "/ping").status_code == 200
    assert httpx.get(srv.base_url + "/health_generate", timeout=30).status_code == 200


def test_draining_server_fails_every_health_check(demo_model_dir) -> None:
    with inprocess_server(demo_model_dir) as (url, app):
        checks = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"),
                  ("GET", "/health_generate")]  # fmt: skip
        for method, path in checks:
            assert httpx.request(method, url + path, timeout=30).status_code == 200, path
        app.state.server.draining = True
        for method, path in checks:
            assert httpx.request(method, url + path, timeout=30).status_code == 503, path
        app.state.server.draining = False
        assert httpx.get(url + "/ping").status_code == 200


def generation_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(r"^detspec:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


def test_health_generate_runs_a_generation(demo_model_dir) -> None:
    with inprocess_server(demo_model_dir) as (url, app):
        engine = app.state.server.engine
        steps, tokens = engine.stats()["num_steps"], generation_tokens(url)
        assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
        assert engine.stats()["num_steps"] > steps  # the engine ran it
        assert generation_tokens(url) == tokens  # a probe, not a request in the metrics
        # Paused, it could not generate until /continue_generation: a 503 at once.
        assert httpx.post(url + "/pause_generation", json={}).status_code == 200
        start = time.monotonic()
        r = httpx.get(url + "/health_generate", timeout=30)
        assert r.status_code == 503 and "paused" in r.json()["error"]["message"], r.text
        assert time.monotonic() - start < 5
        assert httpx.post(url + "/continue_generation", json={}).status_code == 200
        assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
        # An engine that cannot generate fails it; /health, which runs nothing, cannot tell.
        engine.shutdown()
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.get(url + "/health_generate", timeout=30)
        assert r.status_code == 503, r.text
        assert "shut down" in r.json()["error"]["message"], r.text


async def test_health_generate_leaves_concurrent_requests_unchanged(srv) -> None:
    body = gen_body("health-ref", 64, return_logprob=True)
    async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=60) as c:
        alone = (await c.post("/generate", json=body)).json()
        body["rid"] = "health-busy"
        probes = [c.get("/health_generate") for _ in range(8)]
        busy, *checks = await asyncio.gather(c.post("/generate", json=body), *probes)
    assert [r.status_code for r in checks] == [200] * 8
    busy = busy.json()
    assert busy["output_ids"] == alone["output_ids"]
    lps = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in (alone, busy)]
    assert lps[0] == lps[1]


# --------------------------------------------------------------------------- info


def test_get_model_info(srv, demo_model_dir) -> None:
    info = httpx.get(srv.base_url + "/get_model_info", headers=AUTH).json()
    fingerprint = httpx.get(srv.base_url + "/version").json()["fingerprint"]
    assert info["model_path"] == demo_model_dir
    assert info["tokenizer_path"] == demo_model_dir
    assert info["is_generation"] is True
    assert info["weight_version"] == "0"
    assert info["served_model_name"] == SERVED_NAME
    assert info["served_model_names"] == [SERVED_NAME]
    assert info["fingerprint"] == fingerprint
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert info["max_model_len"] == 2048
    # SGLang's newer name for it.
    assert httpx.get(srv.base_url + "/model_info", headers=AUTH).json() == info


def test_get_server_info(srv, demo_model_dir, adapter_dir) -> None:
    r = httpx.get(srv.base_url + "/get_server_info", headers=AUTH)
    assert r.status_code == 200, r.text
    assert API_KEY not in r.text and "api_key" not in r.text
    info = r.json()
    fingerprint = httpx.get(srv.base_url + "/version").json()["fingerprint"]
    assert info["model_path"] == demo_model_dir
    assert info["served_model_name"] == SERVED_NAME
    assert info["context_length"] == info["max_model_len"] == 2048
    assert info["max_running_requests"] == MAX_NUM_SEQS
    assert info["max_queued_requests"] == MAX_WAITING
    assert info["max_request_bytes"] == 16 * 1024 * 1024
    assert (info["dtype"], info["kv_cache_dtype"]) == ("float32", "float32")  # demo: f32
    assert info["determinism"] == "dvr"
    assert info["deterministic_by_default"] is True
    assert info["enable_deterministic_inference"] is True
    assert info["default_seed"] == 3
    assert info["enable_lora"] is True and info["lora_paths"] == {"ad": adapter_dir}
    assert info["tool_call_parser"] is None and info["reasoning_parser"] is None
    assert info["fingerprint"] == fingerprint
    assert (info["weight_version"], info["num_weight_updates"]) == ("0", 0)
    assert info["is_paused"] is False
    assert info["version"] == detspec.__version__
    assert httpx.get(srv.base_url + "/server_info", headers=AUTH).json() == info


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        ({}, ("float32", "float32")),  # the demo checkpoint is float32
        ({"dtype": "bfloat16"}, ("bfloat16", "bfloat16")),  # the KV cache follows (auto)
        ({"dtype": "bfloat16", "kv_cache_dtype": "float32"}, ("bfloat16", "float32")),
    ],
)
def test_engine_reports_its_resolved_dtypes(demo_model_dir, kwargs, want) -> None:
    """What ``/get_server_info`` reports as ``dtype`` and ``kv_cache_dtype``."""
    llm = detspec.LLM(demo_model_dir, num_kv_pages=16, **kwargs)
    try:
        assert (llm.dtype, llm.kv_cache_dtype) == want
    finally:
        llm.shutdown()


# --------------------------------------------------------------------------- abort


async def test_abort_by_rid_ends_that_request_only(srv) -> None:
    async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=120) as c:
        other = asyncio.ensure_future(c.post("/generate", json=gen_body("keep", 600)))
        long = asyncio.ensure_future(c.post("/generate", json=gen_body("long", LONG)))
        assert await abort(c, rid="not-running") == []  # unknown: nothing happens
        await abort_once_running(c, "long")
        long_out, other_out = (await long).json(), (await other).json()
        alone = (await c.post("/generate", json=gen_body("keep-alone", 600))).json()
    meta = long_out["meta_info"]
    assert meta["finish_reason"] == {"type": "abort"}
    assert meta["id"] == "long"
    # (0 when the abort caught it before its first token)
    assert meta["completion_tokens"] == len(long_out["output_ids"]) < LONG
    assert other_out["meta_info"]["finish_reason"] == {"type": "length", "length": 600}
    # deterministic (the server's default): the same bits as when it runs alone
    assert other_out["output_ids"] == alone["output_ids"]
    srv.wait_kv_idle()
    assert srv.metric("detspec:kv_cache_used_pages") == 0


async def test_abort_ends_a_stream_with_an_abort_event(srv) -> None:
    async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=120) as c:
        body = gen_body("streamed", LONG, stream=True)
        async with c.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            lines, events = await first_event_then(resp)
            assert await abort(c, rid="streamed") == ["streamed"]
            events = await rest_of(lines, events)
    last = events[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "abort"}
    assert last["completion_tokens"] < LONG
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


async def test_abort_before_the_request_reaches_the_engine(srv) -> None:
    """Paused, the request waits in its prompt scoring, not yet in the engine (which would
    ignore an abort of an id it does not know): the abort is kept and lands at its first
    output once generation continues."""
    body = gen_body("held", LONG, return_logprob=True, logprob_start_len=0)
    async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=120) as c:
        assert (await c.post("/pause_generation", json={})).status_code == 200
        try:
            held = asyncio.ensure_future(c.post("/generate", json=body))
            await abort_once_running(c, "held")
        finally:
            assert (await c.post("/continue_generation", json={})).status_code == 200
        out = (await held).json()
    assert out["meta_info"]["finish_reason"] == {"type": "abort"}, out["meta_info"]
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < LONG


async def test_abort_all_ends_every_route_and_the_server_serves_on(srv) -> None:
    async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=120) as c:
        async with contextlib.AsyncExitStack() as stack:
            streams = [
                ("POST", "/generate", gen_body("all-1", LONG, stream=True)),
                ("POST", "/generate", gen_body("all-n", LONG, stream=True,
                                               sampling_params={"max_new_tokens": LONG,
                                                                "ignore_eos": True, "n": 2})),
                ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": LONG,
                                             "ignore_eos": True, "stream": True}),
            ]  # fmt: skip
            opened = []
            for method, path, body in streams:
                resp = await stack.enter_async_context(c.stream(method, path, json=body))
                assert resp.status_code == 200
                opened.append(await first_event_then(resp))
            rids = await abort(c, abort_all=True)
            done = [await rest_of(lines, events) for lines, events in opened]
        after = (await c.post("/generate", json=gen_body("after", 16))).json()
    assert rids[:2] == ["all-1", "all-n"] and len(rids) == 3 and rids[2].startswith("cmpl-")
    one, n2, completion = done
    assert one[-1]["meta_info"]["finish_reason"] == {"type": "abort"}
    finals = [e for e in n2 if e["meta_info"]["finish_reason"] is not None]
    assert sorted(e["index"] for e in finals) == [0, 1]
    assert all(e["meta_info"]["finish_reason"] == {"type": "abort"} for e in finals)
    assert all(e["meta_info"]["completion_tokens"] < LONG for e in (one[-1], *finals))
    reasons = [ch["finish_reason"] for e in completion for ch in e["choices"]]
    assert reasons[-1] == "abort" and reasons.count(None) == len(reasons) - 1
    assert after["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    srv.wait_kv_idle()
    assert srv.metric("detspec:kv_cache_used_pages") == 0


def test_abort_request_and_info_need_the_key(srv) -> None:
    r = httpx.post(srv.base_url + "/abort_request", json={"abort_all": True})
    assert r.status_code == 401, r.text
    for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
        assert httpx.get(srv.base_url + path).status_code == 401, path
    # A health check is not behind it.
    assert httpx.get(srv.base_url + "/health_generate", timeout=30).status_code == 200
