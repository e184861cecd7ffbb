"""The engine's channel over a torchft ``Manager``: every pack's all-reduce goes through it.

The engine talks to a *channel* whose ``group`` has ``allreduce(tensors, options)`` and
``rank()``. Here that group forwards each all-reduce to ``manager.allreduce`` (which
waits for the step's quorum, zeroes the tensor of a replica that is healing, and
averages over the participants) and returns a work whose ``wait()`` never raises: a
failed collective is reported to the :class:`~distopt.fault_tolerance.FaultTolerance`
controller, which cuts the group's connections and has the step discarded. Only
all-reduces travel here; the wrapper switches off every other collective of the engine
(small sums as broadcasts, rows as gathers, the plan's broadcast) under fault tolerance.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional, Protocol

from torch import Tensor

__all__ = ["ManagedChannel", "ManagedGroup", "ManagedWork", "Listener"]


class Listener(Protocol):
    """What the channel tells its controller (:class:`distopt.fault_tolerance.FaultTolerance`)."""

    manager: Any

    def before_send(self) -> None:
        """A collective is about to be issued: the step's quorum must be started."""

    def failed(self) -> None:
        """A collective of this step failed."""

    @property
    def rank(self) -> int:
        """This replica's rank among the participants (0 while it heals)."""


class ManagedWork:
    """A pack's all-reduce through the manager; ``wait()`` reports a failure instead of raising.

    Args:
        work: what ``manager.allreduce`` returned.
        listener: the controller to tell of a failure.
    """

    __slots__ = ("work", "listener", "done")

    def __init__(self, work: Any, listener: Listener) -> None:
        self.work = work
        self.listener = listener
        self.done = False

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if not self.done:
            self.done = True
            if self.work.wait() is False or self.listener.manager.errored() is not None:
                self.listener.failed()
        return True

    def is_completed(self) -> bool:
        return self.done


class ManagedGroup:
    """A process group's ``allreduce`` and ``rank`` as the engine calls them, through the manager."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener

    def allreduce(self, tensors: List[Tensor], options: Any) -> ManagedWork:
        self.listener.before_send()
        (tensor,) = tensors
        work = self.listener.manager.allreduce(tensor, reduce_op=options.reduceOp)
        return ManagedWork(work, self.listener)

    def rank(self) -> int:
        return self.listener.rank

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"under fault_tolerance the optimizer's collectives go through the torchft Manager, which only "
            f"all-reduces; this path needs {name!r} (unfreezing parameters mid-training, or a compressor that "
            "gathers, is not supported with fault_tolerance)"
        )


class ManagedChannel:
    """The engine's channel under fault tolerance (the manager is the user's: nothing to destroy)."""

    def __init__(self, listener: Listener) -> None:
        self.group = ManagedGroup(listener)

    def destroy(self) -> None:
        """Nothing: the manager and its process group belong to the user."""
