"""The engine's channel over a torchft ``Manager``: every pack's all-reduce goes through it.

The engine talks to a *channel* whose ``group`` has ``allreduce(tensors, options)``,
``rank()`` and ``size()``, and, for the compressors' codecs (:mod:`distopt.compression`),
``allgather`` and ``alltoall_base``. Here that group issues each of them on the manager's
reconfigurable process group, after the step's quorum, and returns a work whose ``wait()``
never raises: a failed collective is reported to the manager and to the
:class:`~distopt.fault_tolerance.FaultTolerance` controller, which cuts the group's
connections and has the step discarded, on every replica alike (the path an all-reduce's
failure takes). An all-reduce from a replica that heals carries zeros (its flags too, so
that the mean is over the others, exactly); an all-gather or all-to-all travels as the
codec made it, since a codec told ``Round.contributing=False`` sends zeros of its own
encoding and must still send its share of a later stage (its chunk of a sum). The
wrapper switches off the engine's other collectives (small sums as broadcasts, rows as
gathers, the plan's broadcast) under fault tolerance.

``rank()`` and ``size()`` are the process group's: every replica of the quorum is in it,
those that heal too, and issues every collective.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, List, Optional, Protocol

import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed
from torch import Tensor

__all__ = ["ManagedChannel", "ManagedGroup", "ManagedWork", "Listener"]


class Listener(Protocol):
    """What the channel tells its controller (:class:`distopt.fault_tolerance.FaultTolerance`)."""

    manager: Any
    #: This replica takes part in the step's mean (False while it heals: it sends zeros).
    participating: bool

    def enter_round(self) -> None:
        """A collective is about to be issued: the step's quorum must be known."""

    def failed(self, error: Optional[BaseException] = None) -> None:
        """A collective of this step failed (``error``, when it raised here)."""

    def process_group(self) -> Any:
        """The manager's reconfigurable process group, or None to go through ``manager.allreduce``."""

    def group_rank(self) -> int:
        """This replica's rank in the manager's process group (healing replicas are in it too)."""

    def group_size(self) -> int:
        """Replicas in the manager's process group: the quorum, healing replicas included."""


class ManagedWork:
    """A pack's all-reduce on the manager's group; ``wait()`` reports a failure instead of raising.

    Args:
        work: the process group's (or ``manager.allreduce``'s) work, or None when nothing was sent
            (the step had failed already).
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
            try:
                ok = self.work.wait() if self.work is not None else False
            except Exception as error:  # a peer went away, or the group's timeout
                self.listener.failed(error)
            else:
                if ok is False or self.listener.manager.errored() is not None:
                    self.listener.failed()
        return True

    def is_completed(self) -> bool:
        return self.done


class ManagedGroup:
    """A process group's ``allreduce`` and ``rank`` as the engine calls them, on the manager's group.

    The engine sends sums (it has scaled the values by 1/participants while copying them into
    the pack, as it does without fault tolerance), so the all-reduce goes straight to the
    manager's reconfigurable gloo group: none of ``manager.allreduce``'s per-call future chain,
    timer and division pass. What ``manager.allreduce`` does besides is done here too: the
    quorum is waited for first (:meth:`Listener.enter_round`), a replica that heals sends zeros,
    nothing is sent once the step has failed, and an error is reported to the manager (so that
    ``should_commit()`` votes False). A manager without a process group to reach goes through
    ``manager.allreduce(tensor, reduce_op=SUM)``.
    """

    def __init__(self, listener: Listener) -> None:
        self.listener = listener

    def allreduce(self, tensors: List[Tensor], options: Any) -> ManagedWork:
        listener = self.listener
        listener.enter_round()
        (tensor,) = tensors
        manager = listener.manager
        if manager.errored() is not None:
            return ManagedWork(None, listener)  # the step is lost already: send nothing more
        if not listener.participating:
            tensor.zero_()  # healing: its state is replaced at should_commit(); it adds nothing
        group = listener.process_group()
        try:
            if group is None:
                work = manager.allreduce(tensor, reduce_op=options.reduceOp)
            else:
                work = group.allreduce([tensor], options)
        except Exception as error:
            listener.failed(error)
            return ManagedWork(None, listener)
        return ManagedWork(work, listener)

    def allgather(self, outputs: List[List[Tensor]], inputs: List[Tensor],
                  options: Optional[Any] = None) -> ManagedWork:
        """Every replica's ``inputs[0]`` into ``outputs[0]``, in process-group rank order (a codec's stage)."""
        return self._issue("an all-gather", lambda group: group.allgather(
            outputs, inputs, AllgatherOptions() if options is None else options))

    def alltoall_base(self, output: Tensor, input: Tensor, output_splits: List[int], input_splits: List[int],
                      options: Optional[Any] = None) -> ManagedWork:
        """Chunk ``j`` of ``input`` to replica ``j``, chunk ``i`` of ``output`` from replica ``i`` (a codec's stage)."""
        return self._issue("an all-to-all", lambda group: group.alltoall_base(
            output, input, output_splits, input_splits, dist.AllToAllOptions() if options is None else options))

    def _issue(self, what: str, call: Callable[[Any], Any]) -> ManagedWork:
        listener = self.listener
        listener.enter_round()
        if listener.manager.errored() is not None:
            return ManagedWork(None, listener)  # the step is lost already: send nothing more
        group = listener.process_group()
        if group is None:
            raise RuntimeError(
                f"the compressor's codec issues {what}, which under fault_tolerance travels on the torchft Manager's "
                "process group, and distopt reaches the group only of a manager built by "
                "distopt.fault_tolerance.manager.make_manager() (torchft keeps it private); build the manager with "
                "it (its keyword arguments go on to torchft.Manager), or use a compressor that only all-reduces "
                "(compression='fp16', 'bf16' or 'powersgd')"
            )
        try:
            work = call(group)
        except Exception as error:
            listener.failed(error)
            return ManagedWork(None, listener)
        return ManagedWork(work, listener)

    def rank(self) -> int:
        return self.listener.group_rank()

    def size(self) -> int:
        return self.listener.group_size()

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"under fault_tolerance the optimizer's collectives go through the torchft Manager's process group, "
            f"in its commit protocol; this path needs {name!r}, which is not carried there (unfreezing parameters "
            "mid-training is not supported with fault_tolerance)"
        )


class ManagedChannel:
    """The engine's channel under fault tolerance (the manager is the user's: nothing to destroy)."""

    def __init__(self, listener: Listener) -> None:
        self.group = ManagedGroup(listener)

    def destroy(self) -> None:
        """Nothing: the manager and its process group belong to the user."""
