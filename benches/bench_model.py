"""The model a bench script runs on, shared by the scripts (``from bench_model import ...``;
the scripts run as ``python benches/NAME.py``, which puts this folder on ``sys.path``).

``bench_model(None, "bench")`` writes the random-weight benchmark model
(``write_demo_model(dir, "bench", 0)``: nothing is downloaded) into a temporary directory
removed at exit; ``bench_model(DIR)`` uses ``DIR``, writing the model there first when it has
no ``config.json``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path


def bench_model(
    model_dir: str | os.PathLike[str] | None, kind: str = "bench", *, verbose: bool = False
) -> Path:
    """The model directory: ``model_dir``, or a temporary one; the demo model ``kind``
    ("bench" or "tiny", seed 0) is written there unless a model already is."""
    from detspec import _core

    if model_dir is None:
        tmp = tempfile.mkdtemp(prefix=f"detspec-{kind}-model-")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        path = Path(tmp) / kind
    else:
        path = Path(model_dir)
    if not (path / "config.json").exists():
        if verbose:
            print(f"writing the {kind} model to {path}", file=sys.stderr, flush=True)
        path.mkdir(parents=True, exist_ok=True)
        _core.write_demo_model(str(path), kind, 0)
    return path


def model_config(model_dir: str | os.PathLike[str]) -> dict:
    """The model's ``config.json``."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def vocab_size(model_dir: str | os.PathLike[str]) -> int:
    return int(model_config(model_dir)["vocab_size"])
