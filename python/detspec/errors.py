"""Exception classes raised by detspec. The Rust core raises these by name."""

from __future__ import annotations


class DetspecError(Exception):
    """Base class of every error detspec raises."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:  # keeps `param` in pickles
        return (type(self), (str(self), self.param))


class EngineStoppedError(DetspecError):
    """The engine has shut down and accepts no more work."""


class ModelLoadError(DetspecError):
    """A model directory could not be loaded: a missing or corrupt file, an unsupported
    architecture, a missing tensor or one of the wrong shape or dtype. The message names
    the file or tensor at fault."""


class InvalidRequestError(DetspecError, ValueError):
    """A request or parameter was rejected. ``param`` names the parameter at fault
    (``"temperature"``, ``"prompt[1]"``, ``"stop_token_ids"``...) where the error is about
    one, else None; the message names it too. The engine keeps serving other requests."""
