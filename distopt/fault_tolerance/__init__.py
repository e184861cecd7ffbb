"""Fault tolerance on torchft: training goes on when a replica dies, and a replacement heals from a live peer.

``DistributedOptimizer(opt, fault_tolerance=manager)`` takes a torchft ``Manager``
(duck-typed: distopt's core never imports torchft). Every step starts a quorum
(``manager.start_quorum()``, at ``zero_grad()`` or at the first pack of backward),
the packs are summed on the manager's process group in the engine's fixed plan (scaled
by 1/participants as they are copied in), and ``manager.should_commit()`` decides whether
the inner optimizer steps. In local SGD and DiLoCo the quorum and the vote come once per
sync instead, between the exchange and applying it. A step
whose collectives failed because a peer went away is discarded; the survivors go
on at the next step with the mean over the replicas that remain; a restarted
replica heals from a live peer at a step boundary (parameters, optimizer state,
the step count and the mode's state: :mod:`distopt.fault_tolerance.healing`). Compression and
``join()`` work here too (docs/fault-tolerance.md).

What lives here, one concept per module:

- :mod:`.channel`: the engine's channel over the manager's process group (sums only);
- :mod:`.controller`: :class:`FaultTolerance`, a wrapper's quorum, commit and membership;
- :mod:`.wiring`: the wrapper's engine over the manager, and the end of its step (commit or discard);
- :mod:`.membership`: :class:`MembershipEvent`, who left or joined, when, at which step;
- :mod:`.healing`: the state a replacement receives from a live peer;
- :mod:`.compressor_state`: a compressor's state across a step: kept, put back, or what a healer takes;
- :mod:`.sockets`: cutting a failed gloo group's connections, so that no peer waits out a timeout;
- :mod:`.process_group`: torchft's gloo group with that cut (imports torchft when called);
- :mod:`.manager`: :func:`make_manager`, a Manager with the timeouts this needs (imports torchft when called);
- :mod:`.launch`: ``python -m distopt.fault_tolerance.launch``: a lighthouse and one torchrun agent per replica.

See docs/fault-tolerance.md.
"""
from .controller import FaultTolerance, check_arguments
from .membership import MembershipEvent

__all__ = ["FaultTolerance", "MembershipEvent", "check_arguments"]
