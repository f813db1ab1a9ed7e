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
    """``warnings.warn`` attributed to the first frame outside the offload package and
    torch (the user's call of wrap(), step(), state_dict(), or the line of their model's
    forward that called a module whose hook raised it), however deep inside offload it is
    raised, so that a warning filter or the printed location points at the user's code.
    torch's frames in between (a module's ``__call__``, the autograd engine's entry, the
    wrapper of a ``no_grad`` decorator) are skipped as part of the call, and so is the
    ``__init__`` a dataclass generates for one of offload's classes."""
    import os
    import sys
    import warnings

    inside = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        inside += (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,)

    def part_of_the_call(frame) -> bool:
        path = frame.f_code.co_filename
        if path == "<string>" and frame.f_code.co_name == "__init__":
            # the __init__ a dataclass generates (OffloadConfig's calls __post_init__)
            return type(frame.f_locals.get("self")).__module__.startswith("offload.")
        return os.path.abspath(path).startswith(inside)

    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of this function
    while frame is not None and part_of_the_call(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
