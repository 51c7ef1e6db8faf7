"""Exception classes raised by detspec. The Rust core raises these by name."""


class DetspecError(Exception):
    """Base class of every error detspec raises."""


class ModelLoadError(DetspecError):
    """A model directory could not be loaded: a missing or corrupt file, an unsupported
    architecture, a missing tensor or one of the wrong shape or dtype. The message names
    the file or tensor at fault."""


class InvalidRequestError(DetspecError, ValueError):
    """A request or parameter was rejected; the message names the parameter at fault.
    The engine keeps serving other requests."""
