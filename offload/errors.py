"""The exceptions of offload's own that a user may catch (exported as ``offload.<name>``).

Beside them offload raises built-in ones: ``ValueError`` for a bad config or argument,
``OSError`` for a failed I/O, ``RuntimeError`` for a call the engine's state forbids.
"""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing/corrupt file, or a model that differs.
    The message names the file or the parameter."""


class EngineFailedError(RuntimeError):
    """The engine refuses to go on after an I/O failure; the message says how to recover."""


def warn_at_caller(message: str, category: type = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside the offload package (the
    user's call of wrap(), step(), ...), however deep inside offload it is raised, so
    that a warning filter or the printed location points at the user's line."""
    import os
    import sys
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of this function
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
