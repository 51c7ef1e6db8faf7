"""``detspec.ray`` without Ray installed says which extra to install, and ``import detspec``
never imports Ray (both checked in a fresh interpreter, with Ray hidden or watched)."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_missing_ray_names_the_extra() -> None:
    r = run("import sys; sys.modules['ray'] = None; import detspec.ray")
    assert r.returncode != 0
    assert "pip install 'detspec[ray]'" in r.stderr, r.stderr


def test_import_detspec_does_not_import_ray() -> None:
    r = run("import sys, detspec; print('ray' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
