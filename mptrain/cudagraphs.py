"""The CUDA graphs torch.compile skipped (``trainer.compile_mode=reduce-overhead``), said out loud.

Inductor runs a graph it cannot replay as a CUDA graph (one that mutates an input not marked
static, one with CPU ops, ...) as plain kernel launches: the step stays correct and is as slow as
without the mode, and torch says why only under ``TORCH_LOGS=cudagraphs``. A run's summary.json and
a benchmark cell list the skips with inductor's reasons, so that a mode that bought nothing says so.
"""

from __future__ import annotations

import logging

_seen: list[str] = []
_handler: logging.Handler | None = None


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _seen.append(record.getMessage())


def watch() -> int:
    """Collect inductor's skip messages from now on (once a process); returns a mark for ``since``."""
    global _handler
    if _handler is None:
        try:
            from torch._inductor import cudagraph_utils
        except ImportError:  # a torch without inductor's CUDA graphs: nothing to skip
            return 0
        _handler = _Collect(logging.WARNING)
        cudagraph_utils.cudagraphs_log.addHandler(_handler)
    return len(_seen)


def since(mark: int) -> list[str]:
    """The skip messages since ``mark`` (``watch``'s), oldest first."""
    return _seen[mark:]
