"""A fault-tolerant wrapper's quorum, commit and membership: :class:`FaultTolerance`.

Per step, with torchft's ``Manager`` (used duck-typed: this module never imports torchft):

1. ``start()``: ``manager.start_quorum()``, at ``zero_grad()`` (so that the quorum overlaps
   the forward pass) or, at the latest, when backward launches its first pack.
2. When the round opens (the first gradient hook of backward, or an exchange), the quorum is
   waited for and the engine learns how many replicas take part this step: it scales the
   gradients by 1/participants while copying them into the packs, as without fault
   tolerance, and the packs' sums travel on the manager's process group (:mod:`.channel`).
   A replica that heals first compares its settings with those of the live replica it heals
   from, whose state the quorum has brought, and leaves on a mismatch, before any collective
   (:meth:`FaultTolerance._check_settings`).
3. A collective that fails marks the step as failed: the engine then reads nothing back
   (:meth:`distopt.engine.state.RoundHooks.round_failed`: this controller is the engine's round hooks), and this replica *cuts* its
   group's connections at once, so that every survivor still waiting on it fails too
   instead of waiting out gloo's timeout (:mod:`.sockets`).
4. ``commit()``: ``manager.should_commit()``; False discards the step (the inner optimizer
   does not step, and a compressor's state goes back to what it was before the round:
   :mod:`.compressor_state`). A replacement that heals loads a live peer's state inside it.
5. The next quorum says who was missing: a replica in the quorum of a discarded step and not
   in the next one is named in ``last_failure`` and the log, as the stall inspector names a
   rank that stopped answering.

A replica inside ``join()`` that has run out of data *shadows* the others' steps
(:meth:`FaultTolerance.commit` with ``joined=True``): it takes part in each quorum and
collective with zeros and votes not to commit, so that it stays one step behind and heals
from a replica that trained at the next quorum. It thus never serves a stale state to a
replica that heals, and every replica leaves the block with the state of one that trained
the longest.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import Tensor

from ..compression import Compressor
from . import healing
from .channel import ManagedChannel
from .compressor_state import CompressorState
from .membership import MembershipEvent, Record, diff
from .replica_group import group_of

__all__ = ["FaultTolerance", "check_arguments", "WorldCallback"]

logger = logging.getLogger("distopt")

#: Called with each :class:`MembershipEvent`, on the training thread, inside ``step()``.
WorldCallback = Callable[[MembershipEvent], None]

_keys = [0]


def check_arguments(manager: Any, *, bcast_period: int, process_group_size: int, reduce_op: str) -> None:
    """Refuse what fault tolerance cannot do, with the reason. What a mode cannot do under fault
    tolerance (sharded state, a local warm-up, ...) the mode refuses itself
    (:meth:`distopt.modes.Mode.check_compatible`).

    Raises:
        TypeError: ``manager`` is not a torchft ``Manager`` (duck-typed).
        ValueError: a setting that cannot work when replicas come and go.
    """
    missing = [m for m in ("start_quorum", "allreduce", "should_commit", "num_participants",
                           "register_state_dict_fn", "errored") if not callable(getattr(manager, m, None))]
    if missing:
        raise TypeError(
            f"fault_tolerance= takes a torchft Manager (e.g. distopt.fault_tolerance.manager.make_manager()); "
            f"{type(manager).__name__} lacks {', '.join(missing)}"
        )
    if bcast_period > 0:
        raise ValueError(
            "bcast_period > 0 cannot be combined with fault_tolerance: there is no fixed root while replicas come "
            "and go, and healing already gives a replica that joins the live parameters; use bcast_period=0"
        )
    if process_group_size != 1:
        raise ValueError(
            f"with fault_tolerance each replica is one process: the gradients are averaged across replicas through "
            f"the torchft Manager, but this process is in a group of {process_group_size}. Start one process per "
            "replica (python -m distopt.fault_tolerance.launch --replicas N), or leave process_group unset in a "
            "job without a default group of more than one; for replicas of several processes each, pass "
            "mode=distopt.Islands(across=...) (one island per replica: launch with --nproc-per-node K)"
        )
    if reduce_op not in ("mean", "sum"):
        raise ValueError(f"reduce_op must be 'mean' or 'sum', got {reduce_op!r}")


class FaultTolerance:
    """One wrapper's side of torchft: quorum per step, commit vote, healing and membership.

    It is ``opt.fault_tolerance``. Read :attr:`world_size` and :attr:`rank` (this replica's
    place among the replicas averaged this step) to shard data, or pass ``on_world_change``.

    Args:
        manager: a torchft ``Manager`` (duck-typed).
        params: the wrapper's tracked parameters (its own list).
        state_dict: the wrapper's ``state_dict`` (what a replacement receives).
        load_state_dict: the wrapper's ``load_state_dict``.
        get_steps: the committed step count.
        set_steps: sets it (a replica that heals takes its peer's).
        on_world_change: called with each :class:`MembershipEvent` (inside ``step()``), or None.
        compressor: the wrapper's compressor, whose state a discarded step puts back, or None.
        compression_key: where ``state_dict`` holds the compressor's state.
        settings: the wrapper's settings, which a replica that heals compares with its live
            peer's once the quorum is known, before its first collective (None: not compared).
    """

    def __init__(self, manager: Any, *, params: List[Tensor], state_dict: Callable[[], Dict[str, Any]],
                 load_state_dict: Callable[[Dict[str, Any]], None], get_steps: Callable[[], int],
                 set_steps: Callable[[int], None], on_world_change: Optional[WorldCallback] = None,
                 compressor: Optional[Compressor] = None, compression_key: str = "distopt_compression",
                 settings: Optional[Callable[[], Dict[str, Any]]] = None) -> None:
        self.manager = manager
        self.compression = None if compressor is None else CompressorState(compressor)
        self.compression_key = compression_key
        self.params = params
        self.on_world_change = on_world_change
        self.record = Record()
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        self._get_steps = get_steps
        self._set_steps = set_steps
        self._settings = settings
        self._set_world: Callable[[int], None] = lambda world: None
        self._started = False
        self._sized = False  # the engine knows this step's world size
        self._failed = False
        self._healed = False
        self._healed_now = False  # a peer's state was loaded inside this step's should_commit()
        self.participating = True
        # A quorum and a commit vote every step (synchronous training); False in local SGD, where the
        # mode asks for both at each sync.
        self.per_step = True
        self._quorum: Optional[Tuple[Any, ...]] = None
        self._members: Tuple[int, ...] = ()
        self.world_size = 0
        self._rank: Optional[int] = None
        # The manager's process group this step: this replica's rank in it and its size (healing
        # replicas are members too), and the committed step count the quorum agrees on.
        self._group: Tuple[int, int] = (0, 1)
        self.quorum_step = 0
        # Join: this replica has run out of data and shadows the others' steps (see the module).
        self.joined = False
        # The members of the quorum of the last discarded step, until the next quorum says who left.
        self._unexplained: Optional[Tuple[int, ...]] = None
        _keys[0] += 1
        self.key = f"distopt_{_keys[0]}"
        manager.register_state_dict_fn(self.key, self._load, self._save)

    # ------------------------------------------------------------------ wiring

    def channel(self) -> ManagedChannel:
        """The engine's channel: packs go through the manager."""
        return ManagedChannel(self)

    def attach(self, set_world: Callable[[int], None]) -> None:
        """``set_world(n)`` is called before the first collective of each step with the number of
        replicas taking part (the wrapper passes it on to its engine and mode)."""
        self._set_world = set_world

    @property
    def rank(self) -> int:
        """This replica's rank among the replicas averaged this step (0 while it heals)."""
        return self._rank or 0

    @property
    def healed_now(self) -> bool:
        """Whether the last :meth:`commit` loaded a live peer's state into this replica."""
        return self._healed_now

    @property
    def events(self) -> List[MembershipEvent]:
        """Every membership change seen so far, oldest first."""
        return self.record.events

    # ------------------------------------------------------------------ the step

    def start(self) -> None:
        """Start this step's quorum, once (torchft: before the forward pass, for overlap)."""
        if not self._started:
            self._started = True
            self._sized = self._failed = False
            self.manager.start_quorum()

    def enter_round(self) -> None:
        """Before the step's first collective (the engine opens its round): the quorum, the number
        of replicas averaged, and whether this replica takes part (False while it heals)."""
        self.start()
        if not self._sized:
            self._sized = True
            manager = self.manager
            world = int(manager.num_participants())  # waits for the quorum (and a heal's transfer)
            self._check_settings()
            self.world_size = world
            self._rank = manager.participating_rank()
            self.participating = bool(manager.is_participating())
            self.quorum_step = int(manager.current_step())  # a healing replica's is the quorum's already
            self._group = self._group_place(world)
            self._explain_failure()
            if self.compression is not None:
                self.compression.before_round()
            self._set_world(max(world, 1))

    def _check_settings(self) -> None:
        """Refuse to take part in this quorum when the live replica this one heals from was built
        with other settings, before this replica issues any collective.

        Why here, on the healing path: every replica that joins others behind them heals (torchft
        heals each replica not at the quorum's step and, at step 0, every replica but the primary:
        ``init_sync``), and the heal has fetched the live replica's snapshot, with its settings,
        inside the quorum this method comes after (:func:`healing.arrived`). So the comparison
        costs no message of its own, runs on the replica that joins, and is done before its
        first collective: the live replicas never see one that does not pair with theirs (gloo
        aborts a process on a collective whose sizes differ, whichever side it lands on). The
        alternatives need more: torchft's quorum carries no data of the replicas through the
        Manager, and a store key would need a second rendezvous at every quorum on a store that a
        replica learns of only from the quorum. The live replicas define the settings: they never
        compare, and a replica that trains alone defines them for those that come.

        On a mismatch this replica leaves before it raises. It cuts its group's connections, so
        that the live replicas, which are already in the step's first collective with it, fail
        that step at once and discard it, as after any death. And it shuts its manager down, so
        that it stops beating to the lighthouse: a replica that still beats but asks for no
        quorum holds the others' next quorum back (torchft's lighthouse forms none with half of
        the live replicas or fewer, against a split brain), for as long as a process that caught
        the error stays up. The live replicas then go on without it.

        Raises:
            ValueError: a setting differs (:func:`healing.check_settings`: it names the setting,
                both values and the fix).
        """
        if self._settings is None:
            return
        peer = healing.arrived(self.manager, self.key)
        if peer is None:
            return
        try:
            healing.check_settings(peer, self._settings())
        except ValueError as error:
            self.failed(error)
            shutdown = getattr(self.manager, "shutdown", None)
            if callable(shutdown):
                shutdown(wait=False)
            raise ValueError(
                f"{error}. This replica issued no collective and has left the quorum (its torchft Manager is shut "
                "down); the live replicas go on without it"
            ) from None

    def _group_place(self, world: int) -> Tuple[int, int]:
        """This replica's rank in the manager's process group and the group's size (every replica of the
        quorum, healing ones included); without a group to ask, the participants'."""
        group = self.process_group()
        report = getattr(group, "members", None)  # distopt's cuttable group says what its last configure was
        if report is not None:
            return int(report[1]), int(report[2])
        parent = getattr(group, "parent", None)  # torchft's reconfigurable groups wrap a torch group
        if parent is not None and callable(getattr(parent, "size", None)):
            return int(parent.rank()), int(parent.size())
        return self._rank or 0, max(world, 1)

    def group_rank(self) -> int:
        """This replica's rank in the manager's process group this step."""
        return self._group[0]

    def group_size(self) -> int:
        """Replicas in the manager's process group this step (the quorum, healing replicas included)."""
        return self._group[1]

    def _explain_failure(self) -> None:
        """The quorum after a discarded step: name the replicas of the failed step that are not in it.

        They stopped heartbeating to the lighthouse (killed, frozen, unreachable, or ended), which is
        why the step's collectives failed or waited out the timeout: the stall inspector's question
        ("who is missing?"), answered by the lighthouse.
        """
        before, self._unexplained = self._unexplained, None
        report = getattr(self.process_group(), "members", None)
        if before is None or report is None:
            return
        left, _ = diff(before, tuple(report[3]))
        if not left:
            return
        who = (f"replica {left[0]} stopped answering" if len(left) == 1
               else f"replicas {', '.join(map(str, left))} stopped answering")
        cause = (f"{who}: {'it' if len(left) == 1 else 'they'} left the quorum after the discarded step (no "
                 "heartbeat reached the lighthouse in time): killed, frozen, unreachable or ended")
        self.record.last_failure = f"{self.record.last_failure}; {cause}" if self.record.last_failure else cause
        self.record.missing = tuple(left)
        logger.warning("distopt: the step discarded after step %d: %s", self.quorum_step, cause)

    def process_group(self) -> Any:
        """The manager's process group, reached directly, or None (go through ``manager.allreduce``).

        See :func:`distopt.fault_tolerance.replica_group.group_of`.
        """
        group = group_of(self.manager)
        return group if callable(getattr(group, "allreduce", None)) else None

    def failed(self, error: Optional[BaseException] = None) -> None:
        """A collective failed: report it (should_commit() then votes False), discard the step, and
        free every peer waiting on this replica."""
        if error is not None and callable(getattr(self.manager, "report_error", None)):
            self.manager.report_error(error)
        if self._failed:
            return
        self._failed = True
        cut = getattr(self.process_group(), "cut", None)
        if callable(cut):
            cut()

    def round_failed(self) -> bool:
        """Whether this step's collectives failed (the engine reads nothing back then)."""
        return self._failed or self.manager.errored() is not None

    def commit(self, joined: bool = False) -> bool:
        """``manager.should_commit()``: True if the inner optimizer may step (a healing replica has
        taken its peer's state by then). Records the step and any change of membership.

        Args:
            joined: this replica has run out of data (``join()``) and shadows the others' step: it
                votes not to commit, so that it stays one step behind and heals from a replica that
                trained at the next quorum (it never steps, so it must never be a replica that
                another heals from).
        """
        self.start()
        if not self._sized:
            self.enter_round()  # a step without a collective still takes part in the quorum
        failed = self.round_failed()
        error = self.manager.errored()
        self.joined = joined
        if joined and error is None:
            self.manager.report_error(RuntimeError(
                "distopt: this replica has run out of data (join()) and shadows the others' steps"))
        self._healed_now = False
        ok = bool(self.manager.should_commit())
        self._started = False
        if self.compression is not None:
            self.compression.settle(committed=ok, healed=self._healed_now)
        if joined:
            self.record.shadowed += 1
        elif ok:
            self.record.committed += 1
        else:
            self.record.discarded += 1
            self.record.last_failure = str(error).splitlines()[0] if error is not None else (
                "too few replicas for min_replica_size, or a peer of this replica group failed")
            self.record.missing = ()
            logger.warning("distopt: step %d discarded on this replica (%s)", self._get_steps() + 1,
                           self.record.last_failure)
        if (failed or error is not None) and not (joined and error is None):
            self._unexplained = self._members_now()
        self._observe()
        return ok

    def _members_now(self) -> Tuple[int, ...]:
        report = getattr(self.process_group(), "members", None)
        return tuple(report[3]) if report is not None else ()

    def _observe(self) -> None:
        """Record a change of quorum (from the process group's report, else the world size and rank)."""
        members_report = getattr(self.process_group(), "members", None)
        if members_report is not None:
            quorum_id, _, _, members = members_report
            quorum: Tuple[Any, ...] = (quorum_id,)
        else:
            quorum_id, members = -1, ()
            quorum = (self.world_size, self._rank)
        if quorum == self._quorum and not self._healed:
            return
        left, joined = diff(self._members, tuple(members)) if self._quorum is not None else ((), ())
        event = MembershipEvent(step=self._get_steps(), time=time.time(), quorum_id=int(quorum_id),
                                world_size=self.world_size, rank=self._rank, members=tuple(members),
                                left=left, joined=joined, healed=self._healed)
        self._quorum, self._members, self._healed = quorum, tuple(members), False
        self.record.events.append(event)
        logger.info("distopt: %s", event.describe())
        if self.on_world_change is not None:
            self.on_world_change(event)

    # ------------------------------------------------------------------ healing

    def _save(self) -> Dict[str, Any]:
        return healing.snapshot(self.params, self._state_dict, self._get_steps(),
                                None if self._settings is None else self._settings())

    def _load(self, state: Dict[str, Any]) -> None:
        healing.check_settings(state, None if self._settings is None else self._settings())
        optimizer = state.get("optimizer")
        if self.compression is not None and isinstance(optimizer, dict):
            # Not loaded as it came: commit() decides what of it a healing replica takes (compressor_state).
            optimizer = dict(optimizer)
            self.compression.take_peer(optimizer.pop(self.compression_key, None))
            state = dict(state, optimizer=optimizer)
        healing.restore(state, self.params, self._load_state_dict, self._set_steps)
        self._healed_now = True
        if not self.joined:  # a replica that shadows takes a peer's state at every step: no event for it
            self._healed = True
            self.record.heals += 1

    def stats(self) -> Dict[str, Any]:
        """What ``opt.stats.fault_tolerance`` shows."""
        last = self.record.events[-1] if self.record.events else None
        return {
            "world_size": self.world_size, "rank": self._rank, "committed": self.record.committed,
            "discarded": self.record.discarded, "heals": self.record.heals, "shadowed": self.record.shadowed,
            "last_failure": self.record.last_failure, "missing": self.record.missing, "last_event": last,
        }
