"""The built-in default model: a tiny random-weight Llama built locally on first use."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from detspec import _core

_VERSION = "tiny-llama-v1"


def cache_dir() -> Path:
    """Where generated models live: ``$DETSPEC_CACHE`` or ``~/.cache/detspec``."""
    root = os.environ.get("DETSPEC_CACHE") or os.path.join(Path.home(), ".cache", "detspec")
    return Path(root)


def default_model_dir() -> Path:
    """Path of the default model, building it (atomically) if it is not there yet."""
    target = cache_dir() / _VERSION
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    _core.write_demo_model(str(tmp), "tiny", 0)
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        if not (target / "model.safetensors").exists():
            raise
    return target
