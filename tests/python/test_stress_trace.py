"""The DVR stress trace (benches/dvr_stress.py) in the suite, on both CPU kernel profiles: one
trace of deterministic and plain requests replayed in trace order, reversed with forced
rollbacks, with async shuffled arrivals, and chunked with preemption; every deterministic
request must come back bit for bit the same. On the shape-dependent profile rollbacks must
happen by themselves (scenario a has no fault injection)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benches" / "dvr_stress.py"


@pytest.mark.parametrize(
    ("kernel_profile", "strategy"),
    [("invariant", "inline"), ("invariant", "replay"), ("shape_dependent", "replay")],
)
def test_stress_trace_is_bitwise_stable(tmp_path: Path, kernel_profile: str, strategy: str) -> None:
    out = tmp_path / "stress.json"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--num-requests",
            "100",
            "--kernel-profile",
            kernel_profile,
            "--verify-strategy",
            strategy,
            "--model-dir",
            str(tmp_path / "model"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["deterministic_mismatches"] == []
    assert len(summary["scenarios_compared"]) == 4
    # The plain requests did batch differently: the comparison is not blind.
    assert summary["nondeterministic_differing_any"] > 0
    if kernel_profile == "shape_dependent":
        natural = summary["scenarios"]["a-trace-order"]
        assert natural["num_rollbacks"] > 0, natural
