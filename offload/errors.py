"""The exceptions of offload's own that a user may catch (exported as ``offload.<name>``).

Beside them offload raises built-in ones: ``ValueError`` for a bad config or argument,
``OSError`` for a failed I/O, ``RuntimeError`` for a call the engine's state forbids.
"""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing/corrupt file, or a model that differs.
    The message names the file or the parameter."""


class EngineFailedError(RuntimeError):
    """The engine refuses to go on after an I/O failure; the message says how to recover."""
