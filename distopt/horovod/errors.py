"""Horovod's exception types, for code that catches them, and where distopt raises them."""
from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]


class HorovodInternalError(RuntimeError):
    """A collective failed: what ``synchronize()``, ``barrier()``, ``join()`` and the collectives raise.

    As in Horovod, it is the ``RuntimeError`` of a failed collective (ranks that disagree
    on a tensor, a rank that left, a refused collective while a rank has joined), with
    the original message; the original error is its ``__cause__``. Misuse that is caught
    before anything is sent still raises ``ValueError`` or ``TypeError``.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod elastic's interrupt; distopt has no elastic mode, so it is never raised."""


@contextlib.contextmanager
def internal_errors() -> Iterator[None]:
    """Raise a ``RuntimeError`` from the block as :class:`HorovodInternalError`, as Horovod's
    ``synchronize()`` and enqueue functions do (``except RuntimeError: raise HorovodInternalError``)."""
    try:
        yield
    except HorovodInternalError:
        raise
    except RuntimeError as error:
        raise HorovodInternalError(str(error)) from error
