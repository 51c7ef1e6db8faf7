"""detspec on Ray Serve: N replicas of one ``AsyncLLM`` behind Ray's HTTP proxy, router and
autoscaler, each serving the same OpenAI-compatible FastAPI app as ``detspec serve``.

A deterministic output is a pure function of (prompt, params, seed) under one fingerprint, so
replicas need no sticky routing to agree bit for bit; what they do need is the *same*
fingerprint, which :func:`check_replicas` verifies. Every response names the replica that
served it (``x-detspec-replica``) and its fingerprint (``x-detspec-fingerprint``).

Start it with ``serve run detspec.ray:build_app model=DIR num_replicas=2`` or
``serve.run(build_app(model=DIR, num_replicas=2))``. Needs the ``ray`` extra
(``pip install 'detspec[ray]'``); ``import detspec`` never imports this module.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

try:
    from pydantic import BaseModel, ConfigDict, Field, create_model
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as e:  # say which extra brings it, not just the missing module
    raise ImportError(
        f"detspec.ray needs Ray Serve ({e.name} is missing): pip install 'detspec[ray]'"
    ) from e

from detspec.engine_args import ENGINE_SETTINGS, SETTINGS_BY_NAME, EngineSetting
from detspec.errors import DetspecError

# Ray Serve's built-in consistent-hash router: requests with the same `x-session-id` header go
# to the same replica (prefix-cache reuse for a conversation or a shared system prompt).
_SESSION_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
REPLICA_HEADER = "x-detspec-replica"
FINGERPRINT_HEADER = "x-detspec-fingerprint"


class _ServeOptions(BaseModel):
    """The deployment and server fields of :class:`DetspecServeArgs`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="HF model directory (None: the default model)")
    name: str = "detspec"
    num_replicas: int | Literal["auto"] = 1
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per replica")
    # The engine batches internally: Ray's default (5) would queue requests in the proxy that
    # the engine could have batched.
    max_ongoing_requests: int = Field(256, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    routing: Literal["default", "session"] = "default"
    health_check_period_s: float = 10.0
    # server
    served_model_name: str | None = None
    lora_modules: dict[str, str] | None = Field(
        None,
        description="LoRA adapters every replica loads at start-up, served as models: name -> "
        "PEFT directory (needs enable_lora=True)",
    )
    api_key: str | None = None
    max_waiting_requests: int | None = None


def _engine_field(s: EngineSetting) -> tuple[Any, Any]:
    value_type: Any = Literal[s.choices] if s.choices else s.type  # type: ignore[valid-type]
    return (value_type | None, Field(None, description=f"{s.doc} (default {s.default})"))


# What ``build_app`` takes: the fields above plus every engine setting of
# ``detspec.engine_args.ENGINE_SETTINGS`` (None keeps ``AsyncLLM``'s default). ``serve run``
# passes ``key=value`` strings that pydantic converts.
DetspecServeArgs: type[_ServeOptions] = create_model(  # type: ignore[call-overload]
    "DetspecServeArgs",
    __base__=_ServeOptions,
    __doc__="What ``build_app`` takes: deployment, server and engine settings.",
    **{s.name: _engine_field(s) for s in ENGINE_SETTINGS},
)


class _ReplicaHeaders:
    """Adds the replica id and fingerprint to every HTTP response (errors included), so a
    client can tell which replica answered and whether two answers are comparable."""

    def __init__(self, app: ASGIApp, replica: str, engine: Any) -> None:
        self.app = app
        self.replica = replica.encode()
        self.engine = engine  # its fingerprint moves with weight updates: read per response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (REPLICA_HEADER.encode(), self.replica),
                    (FINGERPRINT_HEADER.encode(), self.engine.fingerprint.encode()),
                ]
            await send(message)

        await self.app(scope, receive, send_with_headers)


@serve.ingress()
class DetspecDeployment:
    """One replica: an ``AsyncLLM`` and the ``detspec serve`` app on it (built per replica in
    ``__serve_build_asgi_app__``, because the app's routes close over this replica's engine)."""

    def __init__(
        self,
        model: str | None,
        engine_kwargs: dict[str, Any],
        server: dict[str, Any],
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        from detspec.async_llm import AsyncLLM

        self.engine = AsyncLLM(model, **engine_kwargs)
        for name, path in (lora_modules or {}).items():
            self.engine.load_lora(name, path)
        self.server_options = server
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._state: Any = None

    def __serve_build_asgi_app__(self) -> ASGIApp:
        from detspec.server.app import ServerConfig, build_app

        opts = dict(self.server_options)
        names = opts.pop("served_model_names", None) or [
            os.path.basename(os.path.normpath(self.engine.model))
        ]
        config = ServerConfig(served_model_names=names, **opts)
        app = build_app(self.engine, config)
        self._state = app.state.server
        app.add_middleware(_ReplicaHeaders, replica=self.replica_id, engine=self.engine)
        return app

    def describe(self) -> dict[str, str]:
        """This replica's id and fingerprint (what :func:`check_replicas` collects). The
        fingerprint hashes the weight values, so other weights of the same shapes differ;
        with LoRA adapters loaded, ``+lora:`` and each adapter's name and content hash follow
        (replicas that serve a name with other adapter weights disagree)."""
        fp = self.engine.fingerprint
        adapters = sorted(self.engine.list_loras().items())
        if adapters:
            fp += "+lora:" + ",".join(f"{n}={a['content_hash']}" for n, a in adapters)
        return {"replica": self.replica_id, "fingerprint": fp}

    def check_health(self) -> None:
        """Ray restarts the replica when this raises: the engine is shut down or its engine
        thread no longer answers."""
        if self.engine.is_closed or (self._state is not None and self._state.draining):
            raise DetspecError(f"replica {self.replica_id}: the engine is shut down")
        self.engine.stats()  # raises once the engine thread is gone


def _build(args: Any) -> serve.Application:
    engine_kwargs = {
        s.name: getattr(args, s.name) for s in ENGINE_SETTINGS if getattr(args, s.name) is not None
    }
    server = {
        "api_key": args.api_key,
        "max_waiting_requests": args.max_waiting_requests,
        "max_num_seqs": engine_kwargs.get("max_num_seqs", SETTINGS_BY_NAME["max_num_seqs"].default),
        "served_model_names": [args.served_model_name] if args.served_model_name else None,
    }
    options: dict[str, Any] = {
        "name": args.name,
        "max_ongoing_requests": args.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": args.num_cpus},
        "health_check_period_s": args.health_check_period_s,
    }
    if args.autoscaling_config is not None:
        # Ray refuses a fixed replica count next to an autoscaling config ("auto" is fine).
        if args.num_replicas not in (1, "auto"):
            raise ValueError(
                f"invalid parameter `num_replicas`: {args.num_replicas} fixes the replica count, "
                "which contradicts `autoscaling_config` (leave it out or pass 'auto')"
            )
        options["autoscaling_config"] = args.autoscaling_config
        if args.num_replicas == "auto":
            options["num_replicas"] = "auto"
    else:
        options["num_replicas"] = args.num_replicas
    if args.routing == "session":
        options["request_router_config"] = RequestRouterConfig(request_router_class=_SESSION_ROUTER)
    if args.lora_modules and not args.enable_lora:
        raise ValueError("invalid parameter `lora_modules`: adapters need enable_lora=True")
    deployment = serve.deployment(DetspecDeployment).options(**options)
    return deployment.bind(args.model, engine_kwargs, server, args.lora_modules)


def build_app(args: DetspecServeArgs | Mapping[str, Any] | None = None, /, **options: Any):
    """The Ray Serve application: ``num_replicas`` replicas of one detspec engine.

    ``build_app(model=DIR, num_replicas=2, num_cpus=0.5, determinism="dvr")`` from Python, or
    ``serve run detspec.ray:build_app model=DIR num_replicas=2`` (Ray passes the arguments as
    one dict). Options are the fields of :class:`DetspecServeArgs`; unknown ones are an error
    naming them.
    """
    merged: dict[str, Any] = {}
    if isinstance(args, DetspecServeArgs):
        merged.update(args.model_dump(exclude_unset=True))
    elif args is not None:
        merged.update(args)
    merged.update(options)
    return _build(DetspecServeArgs.model_validate(merged))


# `serve run` accepts only builders of exactly one parameter and converts the CLI's strings to
# that parameter's pydantic annotation; the keyword form above is for Python callers.
build_app.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("args", inspect.Parameter.POSITIONAL_ONLY, annotation=DetspecServeArgs)]
)


# --------------------------------------------------------------------------- replica agreement


class ReplicaMismatchError(DetspecError):
    """Replicas of one deployment report different fingerprints: they would return different
    bits for the same deterministic request."""


@dataclass
class ReplicaReport:
    """What each running replica reported: ``fingerprints`` maps a replica id to its engine
    fingerprint."""

    fingerprints: dict[str, str]
    expected_replicas: int
    unreached: int = 0
    outliers: list[str] = field(default_factory=list)

    @property
    def majority(self) -> str | None:
        if not self.fingerprints:
            return None
        return Counter(self.fingerprints.values()).most_common(1)[0][0]

    @property
    def agree(self) -> bool:
        """All running replicas answered and share one fingerprint."""
        return self.unreached == 0 and len(set(self.fingerprints.values())) <= 1

    def raise_if_mismatch(self) -> None:
        if self.agree:
            return
        if self.outliers:
            detail = ", ".join(f"{r}: {self.fingerprints[r]}" for r in self.outliers)
            raise ReplicaMismatchError(
                f"{len(self.outliers)} replica(s) differ from the majority fingerprint "
                f"{self.majority}: {detail}"
            )
        raise ReplicaMismatchError(
            f"{self.unreached} of {self.expected_replicas} running replica(s) did not answer "
            "the fingerprint probe"
        )


def _running_replicas(handle: DeploymentHandle) -> int:
    app = serve.status().applications.get(handle.app_name)
    if app is None:
        raise DetspecError(f"no running Ray Serve application {handle.app_name!r}")
    dep = app.deployments.get(handle.deployment_name)
    if dep is None:
        raise DetspecError(
            f"application {handle.app_name!r} has no deployment {handle.deployment_name!r}"
        )
    return int(dep.replica_states.get("RUNNING", 0))


async def check_replicas_async(
    handle: DeploymentHandle, timeout_s: float = 30.0, probes: int = 16
) -> ReplicaReport:
    """Probes the deployment until every RUNNING replica reported its fingerprint (the router
    spreads concurrent probes over replicas) or ``timeout_s`` passes."""
    expected = _running_replicas(handle)
    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < expected and time.monotonic() < deadline:
        calls = [handle.describe.remote() for _ in range(max(probes, 2 * expected))]
        for d in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(d, dict):
                seen[d["replica"]] = d["fingerprint"]
        expected = max(expected, _running_replicas(handle))
    report = ReplicaReport(seen, expected, unreached=max(0, expected - len(seen)))
    majority = report.majority
    report.outliers = sorted(r for r, fp in seen.items() if fp != majority)
    return report


def check_replicas(
    handle: DeploymentHandle, timeout_s: float = 30.0, raise_on_mismatch: bool = False
) -> ReplicaReport:
    """Which fingerprint each replica of ``handle``'s deployment serves. A replica whose
    fingerprint differs from the majority (another build, other weights, other determinism
    options) is listed in ``outliers``; ``raise_on_mismatch`` turns that into
    :class:`ReplicaMismatchError`. Call it from a driver, not from inside a running loop
    (use :func:`check_replicas_async` there)."""
    report = asyncio.run(check_replicas_async(handle, timeout_s))
    if raise_on_mismatch:
        report.raise_if_mismatch()
    return report


__all__ = [
    "DetspecDeployment",
    "DetspecServeArgs",
    "ReplicaMismatchError",
    "ReplicaReport",
    "build_app",
    "check_replicas",
    "check_replicas_async",
]
