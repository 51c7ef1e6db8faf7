"""``detspec serve``: an OpenAI-compatible HTTP server on one ``AsyncLLM``.

Needs the ``serve`` extra (``pip install 'detspec[serve]'``: FastAPI, uvicorn,
prometheus-client). Nothing here is imported by ``import detspec``.
"""

from __future__ import annotations

SERVE_DEPENDENCIES = ("fastapi", "uvicorn", "prometheus_client")


def missing_dependencies() -> list[str]:
    """The server's dependencies that cannot be imported."""
    import importlib

    missing = []
    for name in SERVE_DEPENDENCIES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing
