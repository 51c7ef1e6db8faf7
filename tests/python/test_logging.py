"""The core's tracing events reach Python's logging (logger "detspec")."""

from __future__ import annotations

import logging

import pytest

import detspec


def test_core_warnings_reach_python_logging(copy_model_dir, caplog: pytest.LogCaptureFixture):
    d = copy_model_dir("llama")
    (d / "tokenizer.json").unlink()
    with caplog.at_level(logging.WARNING, logger="detspec"):
        llm = detspec.LLM(d)
    msgs = [r.getMessage() for r in caplog.records if r.name == "detspec"]
    assert any("tokenizer.json" in m for m in msgs), msgs
    assert llm.generate([[3, 4, 5]], detspec.SamplingParams(max_tokens=2), use_tqdm=False)
