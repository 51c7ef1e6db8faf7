"""The built-in default model: a small English Llama shipped inside the package.

Used when no model is named (``LLM()``, ``detspec generate``, ``detspec serve``, ``detspec
demo``), so a first run prints words without downloading anything. It is an ordinary Hugging Face
directory and loads through the same path as users' models; ``scripts/train_default_model.py``
trained it on the Python standard library's docstrings and reproduces it (its ``training.json``
records the losses and the weights' hash). Tests and benchmarks build random models instead
(``detspec._core.write_demo_model``).
"""

from __future__ import annotations

from pathlib import Path

from detspec.errors import ModelLoadError

NAME = "detspec-tiny-en"
_DIR = Path(__file__).resolve().parent / "_default_model" / NAME


def default_model_dir() -> Path:
    """Directory of the shipped default model."""
    if not (_DIR / "model.safetensors").is_file():
        # Only a broken install gets here (e.g. package data left out of a wheel).
        raise ModelLoadError(
            f"the built-in default model is missing from this install ({_DIR}); "
            "reinstall detspec or pass a model directory"
        )
    return _DIR
