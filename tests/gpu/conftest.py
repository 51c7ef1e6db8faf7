"""GPU tests: run with the CUDA wheel on a machine with a GPU (`pytest tests/gpu`); everywhere
else every test here is skipped with the reason. Model fixtures are the CPU suite's
(tests/python/conftest.py: tiny random transformers models, built offline)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import detspec

_spec = importlib.util.spec_from_file_location(
    "detspec_cpu_suite_fixtures", Path(__file__).parents[1] / "python" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
# Registered before it runs: its dataclasses look their module up in sys.modules.
sys.modules[_spec.name] = _fixtures
_spec.loader.exec_module(_fixtures)

tokenizer_dir = _fixtures.tokenizer_dir
model_zoo = _fixtures.model_zoo
token_prompts = _fixtures.token_prompts


def pytest_collection_modifyitems(config, items):
    if detspec.cuda_available():
        return
    reason = (
        "no CUDA GPU: this is not the CUDA wheel (scripts/build-cuda-wheel.sh)"
        if not detspec.built_with_cuda()
        else "no CUDA GPU could be opened on this machine"
    )
    for item in items:
        item.add_marker(pytest.mark.skip(reason=reason))
