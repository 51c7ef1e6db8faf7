"""What the HTTP benchmarks share: a free loopback port, waiting for a started server's
``/health``, and ``detspec bench serve`` arguments built in code."""

from __future__ import annotations

import argparse
import socket
import time

import httpx

from detspec.bench import add_bench_arguments


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, timeout: float = 120.0) -> None:
    """Polls ``url/health`` until it answers 200; raises after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready in {timeout}s")


def bench_args(**over: object) -> argparse.Namespace:
    """``detspec bench serve``'s defaults with ``over`` applied."""
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    args = p.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    return args
