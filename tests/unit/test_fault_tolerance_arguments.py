"""What fault_tolerance= refuses, and why, without torchft and without processes.

The manager here is a stand-in that records calls: these tests check the wrapper's
argument checks and refusals only; the behaviour with torchft, real processes and
real gloo is in tests/fault_tolerance/.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import distopt
from distopt.fault_tolerance import MembershipEvent
from distopt.fault_tolerance.membership import diff
from distopt.fault_tolerance.sockets import connections_since, open_sockets


class RecordingManager:
    """Has torchft Manager's methods that the wrapper needs; records state-dict registrations."""

    def __init__(self) -> None:
        self.registered: Dict[str, Any] = {}

    def start_quorum(self) -> None: ...
    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Any: ...
    def should_commit(self) -> bool: return True
    def num_participants(self) -> int: return 1
    def errored(self) -> Any: return None

    def register_state_dict_fn(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        self.registered[key] = (load, save)


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


def test_a_non_manager_is_refused_with_what_it_lacks() -> None:
    with pytest.raises(TypeError, match="lacks start_quorum"):
        distopt.DistributedOptimizer(_opt(), fault_tolerance=object())


@pytest.mark.parametrize("kwargs, match", [
    ({"shard_state": True}, "shard_state=True cannot be combined with fault_tolerance: each rank holds the only copy"),
    ({"bcast_period": 5}, "bcast_period > 0 cannot be combined"),
    ({"sync_every": 8, "sync_fragments": 4, "sync_overlap": 3},
     r"one fragment's sync in flight at a time .* at most the 2 local steps between two launches \(sync_every=8, "
     r"sync_fragments=4\); got sync_overlap=3"),
    ({"sync_every": 4, "local_warmup": 2}, "local_warmup > 0 cannot be combined with fault_tolerance"),
])
def test_settings_that_cannot_work_are_refused_with_the_reason(kwargs: Dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        distopt.DistributedOptimizer(_opt(), fault_tolerance=RecordingManager(), **kwargs)


@pytest.mark.parametrize("streaming", [{}, {"sync_fragments": 2, "sync_overlap": 2}])
def test_local_sgd_and_streaming_are_accepted_and_vote_per_sync_not_per_step(streaming: Dict[str, Any]) -> None:
    opt = distopt.DistributedOptimizer(_opt(), fault_tolerance=RecordingManager(), sync_every=4, **streaming)
    assert opt.fault_tolerance.per_step is False  # the quorum and the vote belong to each sync


@pytest.mark.parametrize("compression", list(distopt.compression.NAMES))
def test_every_compressor_is_accepted(compression: str) -> None:
    opt = distopt.DistributedOptimizer(_opt(), fault_tolerance=RecordingManager(), compression=compression)
    assert opt.fault_tolerance.compression is not None and opt._engine.config.compressor is opt.compressor


def test_what_join_cannot_do_is_refused_with_the_reason() -> None:
    opt = distopt.DistributedOptimizer(_opt(), fault_tolerance=RecordingManager())
    with pytest.raises(ValueError, match="divide_by_world=True\\) cannot be combined with fault_tolerance"):
        with opt.join(divide_by_world=True):
            pass
    other = distopt.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                                         fault_tolerance=RecordingManager())
    with pytest.raises(RuntimeError, match="join\\(\\) over several optimizers is not supported"):
        with distopt.join(opt, other):
            pass
    local = distopt.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                                         fault_tolerance=RecordingManager(), sync_every=4)
    with pytest.raises(RuntimeError, match="join\\(\\) is not supported with fault_tolerance in local SGD"):
        with local.join():
            pass


def test_check_drift_and_closures_are_refused() -> None:
    manager = RecordingManager()
    opt = distopt.DistributedOptimizer(_opt(), fault_tolerance=manager)
    assert len(manager.registered) == 1  # the state a replacement heals from
    with pytest.raises(RuntimeError, match="check_drift\\(\\) is not available"):
        opt.check_drift()
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)


def test_membership_diff_and_description() -> None:
    assert diff((0, 1, 2), (1, 2, 3)) == ((0,), (3,))
    event = MembershipEvent(step=7, time=0.0, quorum_id=3, world_size=2, rank=1, members=(1, 2), left=(0,))
    assert event.describe() == "step 7: 2 replica(s) train together (quorum 3, members [1, 2]); left: [0]"


def test_the_cut_picks_connected_sockets_only() -> None:
    import socket

    before = open_sockets()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        chosen = connections_since(before, exclude_port=None)
        assert set(chosen) == {client.fileno(), server.fileno()}  # not the listener
        assert set(connections_since(before, exclude_port=listener.getsockname()[1])) == {client.fileno()}
    finally:
        for s in (client, server, listener):
            s.close()


def test_the_launchers_replica_ids_name_distinct_replicas_of_the_job() -> None:
    from distopt.fault_tolerance.launch import replica_ids

    assert replica_ids(None, 3) == [0, 1, 2]
    assert replica_ids("2,0", 3) == [2, 0]
    for bad in ("3", "0,0", "", "-1"):
        with pytest.raises(ValueError, match=r"--replica-ids must name distinct replicas in 0\.\.2"):
            replica_ids(bad, 3)
    with pytest.raises(ValueError, match="separated by commas"):
        replica_ids("0;1", 3)


def test_an_advertised_url_keeps_its_port_and_brackets_an_ipv6_host() -> None:
    from distopt.fault_tolerance.manager import advertised_url

    assert advertised_url("http://somehost:8123/checkpoint", "10.0.0.2") == "http://10.0.0.2:8123/checkpoint"
    assert advertised_url("http://[::1]:8123", "fe80::2") == "http://[fe80::2]:8123"


def test_no_interface_owns_a_loopback_or_foreign_address_and_the_users_choice_wins(monkeypatch) -> None:
    from distopt.launching.interface import owning_interface, pick_owning_interface

    assert owning_interface("127.0.0.1") is None
    assert owning_interface("192.0.2.77") is None  # TEST-NET-1: no host here holds it
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert pick_owning_interface("192.0.2.77") is None and os.environ["GLOO_SOCKET_IFNAME"] == "ib0"


def test_streaming_syncs_in_flight_in_a_loaded_checkpoint_are_dropped_with_a_warning() -> None:
    model = torch.nn.Linear(2, 2)
    opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), fault_tolerance=RecordingManager(),
                                       sync_every=4, sync_fragments=2, sync_overlap=1)
    state = opt.state_dict()
    assert state["distopt_local_sgd"]["streaming"]["pending"] == []
    state["distopt_local_sgd"]["streaming"]["pending"] = [
        {"fragment": 0, "launched": 2, "params": [0], "values": [torch.ones(2, 2)]}]
    with pytest.warns(UserWarning, match=r"1 streaming sync\(s\) in flight, which fault_tolerance cannot apply"):
        opt.load_state_dict(state)
    assert opt.state_dict()["distopt_local_sgd"]["streaming"]["pending"] == []


@pytest.mark.parametrize("argv, message", [
    (["--lighthouse", "http://10.0.0.1:29510", "--hostname", "10.0.0.2", "--port", "29511"],
     "--port set(s) up the lighthouse this launcher starts, and with --lighthouse http://10.0.0.1:29510 it starts none"),
    (["--lighthouse", "http://10.0.0.1:29510"],
     "--lighthouse http://10.0.0.1:29510 is on another host, whose replicas would be told to reach this one at "
     "localhost: give --hostname"),
    (["--replica-ids", "0,3"], "--replica-ids must name distinct replicas in 0..2"),
])
def test_the_launchers_flags_that_cannot_work_are_usage_errors(argv: List[str], message: str, capsys: Any) -> None:
    from distopt.fault_tolerance.launch import main

    with pytest.raises(SystemExit) as exc:
        main(["--replicas", "3", *argv, "train.py"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_replica_that_heals_from_a_peer_built_with_other_settings_is_told_which() -> None:
    def build(**streaming: Any) -> Tuple[distopt.DistributedOptimizer, RecordingManager]:
        manager = RecordingManager()
        opt = distopt.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                                           fault_tolerance=manager, sync_every=4, **streaming)
        return opt, manager

    _, peer = build(sync_fragments=2, sync_overlap=1)
    mine, manager = build(sync_fragments=1)
    (peer_load, peer_save), = peer.registered.values()
    (load, save), = manager.registered.values()
    with pytest.raises(ValueError, match=r"built with sync_fragments=1, and the live replica it heals from with "
                                         r"sync_fragments=2; every replica must pass the same arguments"):
        load(peer_save())
    load(save())  # the same settings: taken


class HealingManager(RecordingManager):
    """A manager whose quorum has fetched a live peer's state, unloaded, as torchft 0.2.0 keeps it: this
    replica heals at this step. Records the calls that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[str] = []
        self._pending_state_dict: Dict[str, Any] = {"user": {}, "torchft": {"step": 5, "batches_committed": 5}}

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Any:
        self.calls.append("allreduce")

    def participating_rank(self) -> Any: return None
    def is_participating(self) -> bool: return False
    def current_step(self) -> int: return 5
    def report_error(self, error: Exception) -> None: self.calls.append("report_error")
    def shutdown(self, wait: bool = True) -> None: self.calls.append("shutdown")


def test_a_replica_whose_live_peer_has_other_settings_stops_before_its_first_collective_and_leaves() -> None:
    """The peer's state, with its settings, arrives inside the quorum: the first backward's first pack waits for
    the quorum, compares, and raises ValueError naming the setting and both values before the pack is sent;
    the replica reports the step failed and shuts its manager down (it leaves the quorum). With the same
    settings the pack goes out."""
    peer_manager = RecordingManager()
    distopt.DistributedOptimizer(_opt(), fault_tolerance=peer_manager, pack_threshold=4096)
    (_, peer_save), = peer_manager.registered.values()
    for threshold, refused in ((1024, True), (4096, False)):
        manager = HealingManager()
        model = torch.nn.Linear(2, 2)
        opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), fault_tolerance=manager,
                                           pack_threshold=threshold)
        manager._pending_state_dict["user"] = {key: peer_save() for key in manager.registered}
        opt.zero_grad()
        if refused:
            with pytest.raises(ValueError, match=r"built with pack_threshold=1024, and the live replica it heals from "
                                                 r"with pack_threshold=4096; .* restart this replica with "
                                                 r"pack_threshold=4096 .* This replica issued no collective and has "
                                                 r"left the quorum"):
                model(torch.ones(1, 2)).sum().backward()
            assert manager.calls == ["report_error", "shutdown"]
        else:
            model(torch.ones(1, 2)).sum().backward()
            assert manager.calls[:1] == ["allreduce"]


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_the_launchers_processes_per_replica_must_be_a_positive_number(value: str, capsys: Any) -> None:
    from distopt.fault_tolerance.launch import main

    with pytest.raises(SystemExit) as exc:
        main(["--replicas", "2", "--nproc-per-node", value, "train.py"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--nproc-per-node: takes the number of processes of each replica" in err and repr(value) in err, err


def test_the_launcher_starts_an_agent_of_k_workers_per_island_and_a_lighthouse_on_the_advertised_interface(
        monkeypatch: Any) -> None:
    from distopt.fault_tolerance import launch

    agent = launch.agent_command("train.py", ["--steps", "3"], 1, None, nproc_per_node=4)
    assert agent[agent.index("--nproc-per-node") + 1] == "4" and agent[-3:] == ["train.py", "--steps", "3"]
    assert launch.bind_address("localhost") == "127.0.0.1"  # one host: the loopback interface only
    assert launch.bind_address("192.0.2.77") == "::"  # no interface of this host holds it: every one
    monkeypatch.setattr(launch, "owning_interface", lambda host: ("eth1", "10.0.0.7") if host == "hostA" else None)
    assert launch.bind_address("hostA") == "10.0.0.7"
    command = launch.lighthouse_command(29510, min_replicas=1, heartbeat_timeout_ms=300, join_timeout_ms=200,
                                        quorum_tick_ms=10, bind="fd00::2")
    assert command[command.index("--bind") + 1] == "[fd00::2]:29510"


def test_islands_take_fault_tolerance_across_per_step_or_per_sync_and_refuse_what_they_cannot_do() -> None:
    opt = distopt.DistributedOptimizer(_opt(), mode=distopt.Islands(), fault_tolerance=RecordingManager())
    assert opt.fault_tolerance.per_step is True  # synchronous across: the wrapper's quorum and vote, every step
    diloco = distopt.Islands(across=distopt.DiLoCo(every=4, outer=lambda ps: torch.optim.SGD(ps, lr=0.7)))
    opt = distopt.DistributedOptimizer(_opt(), mode=diloco, fault_tolerance=RecordingManager())
    assert opt.fault_tolerance.per_step is False  # DiLoCo across: each sync's
    with pytest.raises(ValueError, match=r"islands= cannot be combined with fault_tolerance: there each island is a "
                                         r"torchft replica group.* --nproc-per-node K\)"):
        distopt.DistributedOptimizer(_opt(), mode=distopt.Islands(islands=[[0]]), fault_tolerance=RecordingManager())
    with pytest.raises(ValueError, match=r"compression='int8' across the islands is not supported yet with "
                                         r"distopt.Islands under fault_tolerance"):
        distopt.DistributedOptimizer(_opt(), mode=distopt.Islands(compression="int8"),
                                     fault_tolerance=RecordingManager())


def test_the_checkpoint_server_listens_on_the_advertised_interface_only() -> None:
    pytest.importorskip("torchft")
    from datetime import timedelta

    from distopt.fault_tolerance.manager import _http_transport, listening_address

    assert listening_address("localhost") == "127.0.0.1" and listening_address("192.0.2.77") is None
    transport = _http_transport("localhost", timedelta(seconds=5))
    try:
        host, port = transport._server.socket.getsockname()[:2]
        assert host == "127.0.0.1" and transport.address() == f"http://localhost:{port}/checkpoint/"
    finally:
        transport.shutdown()
