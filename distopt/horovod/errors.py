"""Horovod's exception types, for code that catches them."""
from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]


class HorovodInternalError(RuntimeError):
    """Horovod's error for a failed collective; distopt raises ``RuntimeError``s (of which this is one)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod elastic's interrupt; distopt has no elastic mode, so it is never raised."""
