"""User-facing errors: one line that names the bad value and what is allowed, never a traceback."""

from __future__ import annotations


class MptrainError(Exception):
    """A problem with the user's input (config, data, checkpoint) rather than a bug in mptrain.

    The CLI prints ``mptrain: error: <message>`` and exits with status 2.
    """


class DivergedError(MptrainError):
    """The loss stayed non-finite for ``trainer.max_nonfinite_steps`` consecutive steps, or the
    run's final loss is non-finite. The CLI prints ``mptrain: diverged: <message>``, exit status 3."""


def check(cond: bool, message: str) -> None:
    """Raise MptrainError(message) unless cond holds."""
    if not cond:
        raise MptrainError(message)
