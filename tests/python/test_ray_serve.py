"""detspec on Ray Serve, over real HTTP through Ray's proxy: two replicas of the tiny demo model
on a local 2-CPU Ray cluster.

* The same deterministic request (greedy, and seeded at temperature 0.8), sent many times while
  other clients stream random requests, is served by both replicas (the replica id comes back in
  a header) and every copy is identical in token ids and logprob bits; without
  ``deterministic`` the same comparison differs at least once (negative control).
* Replicas on different weights are reported by ``check_replicas``.
* A replica killed mid-run: its in-flight requests end with an error status or a dropped
  connection (never a hang), a retrying client gets every answer, Ray starts a replacement and
  the replacement returns the same bits as before.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import random
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_fixtures import demo_model_dir, free_port, write_adapter  # noqa: F401

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from ray import serve  # noqa: E402
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary  # noqa: E402

import detspec  # noqa: E402
from detspec.ray import (  # noqa: E402
    FINGERPRINT_HEADER,
    REPLICA_HEADER,
    ReplicaMismatchError,
    build_app,
    check_replicas,
)

pytestmark = pytest.mark.ray

SERVED = "tiny"
APP = "detspec"
TARGET_PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 900, size=17)]
NUM_CLIENTS = 16


def engine_options(model: str, **kw):
    """Two replicas share 2 CPUs: half a CPU each for Ray's accounting, but two engine threads
    each: with one thread the fast path's split-KV heuristic picks a single split for every
    batch of the tiny model (4 tasks per thread), so there would be no batch variance for the
    negative control to see."""
    opts = dict(
        model=model,
        num_replicas=2,
        num_cpus=0.5,
        num_threads=2,
        max_model_len=256,
        num_kv_pages=1024,
        served_model_name=SERVED,
        health_check_period_s=2.0,
    )
    opts.update(kw)
    return opts


@pytest.fixture(scope="module")
def ray_http() -> Iterator[str]:
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 * 1024**2,
        log_to_driver=False,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def two_replicas(ray_http, demo_model_dir, tmp_path_factory):
    """Two replicas of the demo model, each serving the LoRA adapter "a" too."""
    adapter = write_adapter(tmp_path_factory.mktemp("ray-lora"), "a", 1)
    opts = engine_options(demo_model_dir, enable_lora=True, lora_modules={"a": adapter})
    handle = serve.run(build_app(**opts), name=APP, route_prefix="/")
    return ray_http, handle


def target_body(temperature: float, deterministic: bool) -> dict:
    return {
        "model": SERVED,
        "prompt": TARGET_PROMPT,
        "max_tokens": 32,
        "temperature": temperature,
        "seed": 1234,
        "logprobs": 2,
        "deterministic": deterministic,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def bits(body: dict) -> tuple:
    ch = body["choices"][0]
    lp = ch["logprobs"]
    return (
        tuple(ch["token_ids"]),
        tuple(struct.pack("<f", x) for x in lp["token_logprobs"]),
        tuple(tuple(sorted((k, struct.pack("<f", v)) for k, v in d.items()))
              for d in lp["top_logprobs"]),
        body["system_fingerprint"],
    )  # fmt: skip


async def post(client: httpx.AsyncClient, body: dict) -> tuple[str, tuple]:
    """(replica that served it, its bits)."""
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    # The replica's engine fingerprint; an adapter's answer names its adapter before it.
    fp = r.json()["system_fingerprint"]
    assert fp.endswith(r.headers[FINGERPRINT_HEADER].removeprefix("detspec-")), fp
    return r.headers[REPLICA_HEADER], bits(r.json())


async def load_client(client: httpx.AsyncClient, rng: random.Random, stop, counter) -> None:
    """Streams random requests until ``stop``; counts the chunks it received."""
    while not stop.is_set():
        body = {
            "model": SERVED,
            "prompt": [rng.randrange(3, 900) for _ in range(rng.randint(1, 90))],
            "max_tokens": rng.randint(4, 40),
            "temperature": rng.choice([0.0, 1.0]),
            "seed": rng.randrange(2**31),
            "stream": True,
            "ignore_eos": True,
            "deterministic": rng.random() < 0.3,
        }
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    counter[0] += 1


async def targets_under_load(
    base_url: str, body: dict, seed: int, min_copies: int, max_copies: int
) -> list[tuple[str, tuple]]:
    """Sends ``body`` at least ``min_copies`` times (two at a time, so both replicas get
    copies) while NUM_CLIENTS clients stream; keeps going up to ``max_copies`` until both
    replicas have served it."""
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        stop = asyncio.Event()
        streamed = [0]
        tasks = [
            asyncio.create_task(load_client(client, random.Random(seed * 100 + i), stop, streamed))
            for i in range(NUM_CLIENTS)
        ]
        try:
            deadline = time.monotonic() + 60
            while streamed[0] < NUM_CLIENTS and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert streamed[0] > 0, "the load never started"
            got: list[tuple[str, tuple]] = []
            rng = random.Random(seed)
            while len(got) < min_copies or (len({r for r, _ in got}) < 2 and len(got) < max_copies):
                await asyncio.sleep(rng.uniform(0.0, 0.2))
                before = streamed[0]
                got += await asyncio.gather(post(client, body), post(client, body))
                assert streamed[0] > before, "the load was not running during the target"
            return got
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()


# --------------------------------------------------------------------------- builder


def test_builder_takes_serve_run_strings_and_rejects_unknown_options(demo_model_dir) -> None:
    """``serve run detspec.ray:build_app model=DIR num_replicas=2`` hands the builder a dict of
    strings; Ray's own call path converts them. Unknown options are an error naming them."""
    app = call_user_app_builder_with_args_if_necessary(
        build_app, {"model": demo_model_dir, "num_replicas": "2", "num_cpus": "0.5"}
    )
    assert isinstance(app, serve.Application)
    with pytest.raises(ValueError, match="num_replica"):
        build_app(model=demo_model_dir, num_replica=2)
    with pytest.raises(ValueError, match="enable_lora"):
        build_app(model=demo_model_dir, lora_modules={"a": demo_model_dir})
    with pytest.raises(ValueError, match="determinism"):
        build_app(model=demo_model_dir, determinism="sometimes")


def test_builder_passes_deployment_options_through(demo_model_dir) -> None:
    auto = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 64}
    app = build_app(
        model=demo_model_dir, autoscaling_config=auto, num_cpus=0.5, max_ongoing_requests=99
    )
    d = app._bound_deployment
    assert d.max_ongoing_requests == 99
    assert d.ray_actor_options["num_cpus"] == 0.5
    assert d._deployment_config.autoscaling_config.max_replicas == 3
    with pytest.raises(ValueError, match="num_replicas"):
        build_app(model=demo_model_dir, autoscaling_config=auto, num_replicas=2)
    app = build_app(model=demo_model_dir, routing="session")
    router = app._bound_deployment._deployment_config.request_router_config
    assert router.request_router_class.endswith("ConsistentHashRouter")


# --------------------------------------------------------------------------- agreement


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replicas_agree_bitwise_under_load(two_replicas, temperature) -> None:
    base_url, _ = two_replicas
    body = target_body(temperature, deterministic=True)
    copies = asyncio.run(
        targets_under_load(base_url, body, int(temperature * 10), min_copies=12, max_copies=40)
    )
    replicas = {r for r, _ in copies}
    assert len(replicas) == 2, f"only {replicas} served the target in {len(copies)} copies"
    first = copies[0][1]
    assert len(first[0]) == 32
    for i, (replica, got) in enumerate(copies):
        assert got[0] == first[0], f"copy {i} (replica {replica}): token ids differ"
        assert got[1] == first[1], f"copy {i} (replica {replica}): logprob bits differ"
        assert got[2] == first[2], f"copy {i} (replica {replica}): top-logprob bits differ"
        assert got[3] == first[3], f"copy {i} (replica {replica}): fingerprint differs"


def test_replicas_agree_bitwise_on_the_shape_dependent_profile(ray_http, demo_model_dir) -> None:
    """The same agreement on the replay test profile, where every GEMM's bits change with the
    batch's row count: each replica's fast path really diverges and its verifier rolls back,
    and both still return the same bits."""
    opts = engine_options(
        demo_model_dir,
        name="shapedep",
        num_cpus=0.25,
        kernel_profile="shape_dependent",
        verify_window=8,
        verify_group=4,
    )
    handle = serve.run(build_app(**opts), name="shapedep", route_prefix="/shapedep")
    try:
        assert check_replicas(handle, raise_on_mismatch=True).agree
        body = target_body(0.8, deterministic=True)
        copies = asyncio.run(
            targets_under_load(ray_http + "/shapedep", body, 41, min_copies=8, max_copies=30)
        )
        assert len({r for r, _ in copies}) == 2, "one replica served every copy"
        first = copies[0][1]
        assert "-shapedep-" in first[3]
        for i, (replica, got) in enumerate(copies):
            assert got == first, f"copy {i} (replica {replica}) differs"
    finally:
        serve.delete("shapedep")


def test_negative_control_plain_requests_differ_under_load(two_replicas) -> None:
    """Without ``deterministic`` the fast path's batch variance shows in the bits of at least
    one copy: the test above can tell agreeing replicas from lucky ones."""
    base_url, _ = two_replicas
    body = target_body(0.8, deterministic=False)
    with httpx.Client(base_url=base_url, timeout=60) as c:
        solo = bits(c.post("/v1/completions", json=body).json())
    runs = 0
    for seed in range(4):
        copies = asyncio.run(
            targets_under_load(base_url, body, 100 + seed, min_copies=8, max_copies=8)
        )
        runs += len(copies)
        if any(got[:3] != solo[:3] for _, got in copies):
            return
    pytest.fail(f"{runs} plain requests under load were all bitwise identical to the solo run")


def test_models_route_and_check_replicas_report_one_fingerprint(two_replicas) -> None:
    base_url, handle = two_replicas
    report = check_replicas(handle, raise_on_mismatch=True)
    assert report.agree and report.expected_replicas == 2 and len(report.fingerprints) == 2
    card, adapter = httpx.get(base_url + "/v1/models", timeout=30).json()["data"]
    assert adapter["id"] == "a" and adapter["parent"] == SERVED
    lora_hash = adapter["fingerprint"].removeprefix("detspec-lora")[:16]
    assert report.majority == f"{card['fingerprint']}+lora:a={lora_hash}"


def test_replicas_serve_a_lora_adapter_bitwise_alike(two_replicas) -> None:
    """Every replica loaded the deployment's adapter: a deterministic answer of it is the
    same bits whichever replica serves it, under load, and not the base model's."""
    base_url, _ = two_replicas
    body = {**target_body(0.8, deterministic=True), "model": "a"}
    copies = asyncio.run(targets_under_load(base_url, body, 5, min_copies=8, max_copies=30))
    assert len({r for r, _ in copies}) == 2, "one replica served every copy"
    assert all(got == copies[0][1] for _, got in copies)
    assert copies[0][1][3].startswith("detspec-lora")
    base = httpx.post(base_url + "/v1/completions", json=target_body(0.8, True), timeout=60)
    assert tuple(base.json()["choices"][0]["token_ids"]) != copies[0][1][0]


def test_check_replicas_reports_a_replica_on_other_weights(ray_http, tmp_path: Path) -> None:
    """Two replicas load weights A; the directory then gets other weights of the same shapes
    (another seed) and one replica dies: Ray's replacement loads the new files and serves other
    bits, and the check says so: the fingerprint hashes the weight values, not the
    safetensors header both checkpoints share."""
    model = tmp_path / "model"
    detspec._core.write_demo_model(str(model), "tiny", 5)
    opts = engine_options(str(model), name="mixed", num_cpus=0.25, max_num_seqs=8)
    handle = serve.run(build_app(**opts), name="mixed", route_prefix="/mixed")
    try:
        before = check_replicas(handle, raise_on_mismatch=True)
        assert len(before.fingerprints) == 2
        shutil.rmtree(model)
        detspec._core.write_demo_model(str(model), "tiny", 6)
        victim = next(iter(before.fingerprints))
        ray.kill(replica_actor("mixed", victim), no_restart=True)
        now = wait_for_replacement(handle, victim)
        report = check_replicas(handle)
        assert set(report.fingerprints) == now
        assert len(set(report.fingerprints.values())) == 2, report
        assert not report.agree and len(report.outliers) == 1
        with pytest.raises(ReplicaMismatchError, match="differ from the majority fingerprint"):
            report.raise_if_mismatch()
    finally:
        serve.delete("mixed")


def test_session_routing_pins_a_session_to_one_replica(ray_http, demo_model_dir) -> None:
    """``routing="session"``: requests with one ``x-session-id`` all land on one replica (its
    prefix cache), while different sessions spread over both."""
    opts = engine_options(demo_model_dir, name="sticky", num_cpus=0.25, routing="session")
    serve.run(build_app(**opts), name="sticky", route_prefix="/sticky")
    try:
        body = {"model": SERVED, "prompt": TARGET_PROMPT, "max_tokens": 2}
        by_session: dict[str, set[str]] = {}
        with httpx.Client(base_url=ray_http + "/sticky", timeout=60) as c:
            for i in range(64):
                sid = f"conversation-{i % 16}"
                r = c.post("/v1/completions", json=body, headers={"x-session-id": sid})
                assert r.status_code == 200, r.text
                by_session.setdefault(sid, set()).add(r.headers[REPLICA_HEADER])
        assert all(len(v) == 1 for v in by_session.values()), by_session
        assert len(set().union(*by_session.values())) == 2, by_session
    finally:
        serve.delete("sticky")


# --------------------------------------------------------------------------- replica death


def replica_actor(app: str, replica_id: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(f"SERVE_REPLICA::{app}#") and a["name"].endswith(replica_id):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise LookupError(f"no actor for replica {replica_id}")


def running_replicas(handle) -> set[str]:
    return set(check_replicas(handle, timeout_s=10).fingerprints)


def wait_for_replacement(handle, victim: str, timeout: float = 120) -> set[str]:
    """The running replicas once Ray has replaced ``victim``."""
    deadline = time.monotonic() + timeout
    now = running_replicas(handle)
    while (victim in now or len(now) < 2) and time.monotonic() < deadline:
        time.sleep(1)
        now = running_replicas(handle)
    assert victim not in now and len(now) == 2, f"no replacement for {victim}: {now}"
    return now


async def stream_outcome(client: httpx.AsyncClient, i: int, in_flight: dict[str, int]) -> str:
    """One streamed request: "ok", "error <status>", "cut" (the stream ended without
    ``[DONE]``) or "dropped" (the connection failed). ``in_flight`` counts, per replica, the
    streams started and not yet ended."""
    body = {
        "model": SERVED,
        "prompt": [3 + (7 * i + j) % 800 for j in range(40)],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"error {r.status_code}"
            replica = r.headers[REPLICA_HEADER]
            in_flight[replica] = in_flight.get(replica, 0) + 1
            done = False
            try:
                async for line in r.aiter_lines():
                    done = done or line == "data: [DONE]"
            finally:
                in_flight[replica] -= 1
            return "ok" if done else "cut"
    except httpx.HTTPError:
        return "dropped"


async def post_with_retries(client: httpx.AsyncClient, body: dict, tries: int = 20) -> dict:
    """What a client does on a 5xx or a dropped connection: try again (like openai's client)."""
    for _ in range(tries):
        try:
            r = await client.post("/v1/completions", json=body)
            if r.status_code == 200:
                return r.json()
            assert r.status_code >= 500, r.text
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise AssertionError(f"no answer after {tries} tries")


def test_killed_replica_fails_cleanly_and_its_replacement_agrees(two_replicas) -> None:
    base_url, handle = two_replicas
    body = target_body(0.8, deterministic=True)
    with httpx.Client(base_url=base_url, timeout=60) as c:
        before = bits(c.post("/v1/completions", json=body).json())
    old = running_replicas(handle)
    assert len(old) == 2

    async def run() -> tuple[list[str], str, list[dict]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=90) as client:
            in_flight: dict[str, int] = {}
            streams = [asyncio.create_task(stream_outcome(client, i, in_flight)) for i in range(12)]
            # Kill the busiest replica once both have started streams, while it has some in
            # flight (waiting on a clock instead let fast runs finish every stream first).
            deadline = time.monotonic() + 60
            busy: dict[str, int] = {}
            while time.monotonic() < deadline:
                busy = {r: n for r, n in in_flight.items() if n > 0}
                if len(in_flight) >= 2 and busy:
                    break
                await asyncio.sleep(0.01)
            assert busy, f"no stream in flight to cut: {in_flight}"
            victim = max(busy, key=lambda r: busy[r])
            ray.kill(replica_actor(APP, victim), no_restart=True)
            # Requests sent right after the kill, by a client that retries.
            retried = await asyncio.gather(
                *(post_with_retries(client, {**body, "seed": s}) for s in range(6))
            )
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), 120)
            return outcomes, victim, retried

    outcomes, victim, retried = asyncio.run(run())
    print("outcomes of the streams in flight at the kill:", outcomes)
    assert "ok" in outcomes, outcomes  # the surviving replica finished its streams
    assert all(o in ("ok", "cut", "dropped") or o.startswith("error 5") for o in outcomes), outcomes
    assert any(o != "ok" for o in outcomes), f"the kill hit no request in flight: {outcomes}"
    assert all(len(r["choices"][0]["token_ids"]) == 32 for r in retried)

    # Ray replaces the dead replica; the replacement returns the bits from before the kill.
    (new,) = wait_for_replacement(handle, victim) - old

    async def until_new_serves() -> list[tuple[str, tuple]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            got: list[tuple[str, tuple]] = []
            while new not in {r for r, _ in got} and len(got) < 40:
                got += await asyncio.gather(*(post(client, body) for _ in range(4)))
            return got

    got = asyncio.run(until_new_serves())
    assert new in {r for r, _ in got}, f"the replacement {new} never served the target"
    for replica, b in got:
        assert b == before, f"replica {replica} after the restart differs from before"
