"""``detspec demo --quick`` (the CI form) on the built-in model: the deterministic request is
bitwise identical to its solo run in every round, and the determinism="off" control differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENV = {**os.environ, "TQDM_DISABLE": "1"}


def test_quick_demo_verdict() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "detspec", "demo", "--quick", "--json"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    modes = {m["mode"]: m for m in doc["modes"]}
    assert set(modes) == {"dvr", "dvr-replay", "off"}
    assert doc["deterministic_all_equal"]
    for name in ("dvr", "dvr-replay"):
        m = modes[name]
        assert m["rounds"] and m["all_equal"], m
        assert all(rd["digest"] == m["solo_digest"] for rd in m["rounds"])
        assert all("-dvr-" in rd["fingerprint"] for rd in m["rounds"])
    assert modes["dvr-replay"]["stats"]["num_verify_passes"] > 0
    assert doc["off_differs"] and modes["off"]["differing_rounds"] > 0, modes["off"]


def test_help_documents_every_option() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "detspec", "demo", "--help"],
        capture_output=True, text=True, timeout=60, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0
    for opt in ("--quick", "--json", "--model", "--modes", "--seed", "--max-tokens"):
        assert opt in r.stdout


def test_bad_mode_is_a_clear_error() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "detspec", "demo", "--modes", "sometimes"],
        capture_output=True, text=True, timeout=60, env=ENV,
    )  # fmt: skip
    assert r.returncode == 2 and "--modes" in r.stderr
