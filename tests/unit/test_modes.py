"""The modes, one process: their arguments, settings and state, driven against a fake engine.

Each mode is a public object that owns its arguments (``mode=distopt.DiLoCo(...)``), and the flat
keyword arguments are shorthands that build one. What a mode does at ``step()`` is checked here
without processes, as torchft tests its local SGD against ``create_autospec(Manager)``: the engine
is ``create_autospec(GradientEngine)``, and a sync's mean is whatever the test says the other
ranks sent.
"""
from __future__ import annotations

import gc
import re
from types import SimpleNamespace
from typing import Any, Callable, List, Optional
from unittest.mock import Mock, create_autospec

import pytest
import torch
from torch import nn

import distopt
from distopt import DistributedOptimizer
from distopt.engine import GradientEngine
from distopt.modes import MODES, Mode, ModeContext, settings_of
from distopt.modes.local_sgd import STATE_KEY
from distopt.modes.shorthands import from_keywords
from distopt.modes.streaming import StreamingMode
from distopt.wrapper import checks

OUTER = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


# ---------------------------------------------------------------------- the public objects


def test_each_public_mode_is_exported_and_documented_with_a_whole_training_loop() -> None:
    for cls in MODES:
        assert getattr(distopt, cls.__name__) is cls and cls.__name__ in distopt.__all__
        doc = cls.__doc__ or ""
        assert "Example::" in doc and "opt.step()" in doc and f"mode=distopt.{cls.__name__}(" in doc, cls


def test_a_mode_object_trains_as_its_shorthand_does_in_one_process() -> None:
    runs = []
    for kwargs in ({"mode": distopt.DiLoCo(2, OUTER, warmup=1)}, {"sync_every": 2, "outer_optimizer": OUTER,
                                                                   "local_warmup": 1}):
        net = model()
        opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)
        for t in range(5):
            opt.zero_grad()
            net(torch.full((4, 3), float(t))).pow(2).sum().backward()
            opt.step()
        runs.append([p.detach().clone() for p in net.parameters()])
        assert isinstance(opt.mode, distopt.DiLoCo)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_the_shorthands_build_the_mode_objects_and_name_the_same_settings() -> None:
    assert type(from_keywords()) is distopt.Synchronous
    assert type(from_keywords(shard_state=True)) is distopt.ShardedState
    assert type(from_keywords(sync_every=8)) is distopt.LocalSGD
    assert type(from_keywords(sync_every=1, outer_optimizer=OUTER)) is distopt.DiLoCo
    streaming = from_keywords(sync_every=8, outer_optimizer=OUTER, sync_fragments=2, sync_overlap=1)
    assert isinstance(streaming, distopt.DiLoCo) and isinstance(streaming, StreamingMode)
    # Two ranks, one with the shorthands and one with the object, agree: the settings are keyed alike.
    assert settings_of(streaming) == settings_of(distopt.DiLoCo(8, OUTER, fragments=2, overlap=1))
    assert settings_of(from_keywords(sync_every=8)) == settings_of(distopt.LocalSGD(8))
    assert settings_of(from_keywords(shard_state=True)) == settings_of(distopt.ShardedState())


def test_a_mode_declares_its_settings_by_the_keywords_a_user_writes() -> None:
    assert distopt.Synchronous().settings() == {}
    assert distopt.ShardedState().settings() == {"shard_state": True, "shard_state_share": "in_step"}
    assert distopt.ShardedState(share="background").settings()["shard_state_share"] == "background"
    assert distopt.LocalSGD(8, warmup=2).settings() == {"sync_every": 8, "local_warmup": 2, "outer_optimizer": False}
    assert distopt.DiLoCo(8, OUTER, fragments=4, overlap=2, mixing=0.5).settings() == {
        "sync_every": 8, "local_warmup": 0, "outer_optimizer": True, "sync_fragments": 4, "sync_overlap": 2,
        "sync_mixing": 0.5}
    # What a mode lacks, the ranks compare as another mode has it: sync_every=1 is synchronous training.
    assert settings_of(distopt.Synchronous())["sync_every"] == 1
    assert settings_of(distopt.LocalSGD(4))["sync_fragments"] is None


def test_fragments_overlap_or_mixing_make_a_local_mode_streaming_and_it_stays_what_the_user_built() -> None:
    plain, streaming = distopt.LocalSGD(8), distopt.LocalSGD(8, mixing=0.0)
    assert not isinstance(plain, StreamingMode) and isinstance(streaming, StreamingMode)
    assert isinstance(streaming, distopt.LocalSGD) and not isinstance(streaming, distopt.DiLoCo)
    assert repr(streaming) == "LocalSGD(every=8, mixing=0.0)"
    assert repr(distopt.DiLoCo(16, OUTER, warmup=3, fragments=4)) == "DiLoCo(every=16, outer=..., warmup=3, fragments=4)"


@pytest.mark.parametrize("build, error, match", [
    (lambda: distopt.LocalSGD(0), ValueError, r"every must be an int >= 1 .*got 0"),
    (lambda: distopt.LocalSGD(2.5), TypeError, r"every must be an int, got 2.5; pass e.g. every="),
    (lambda: distopt.LocalSGD(4, warmup=-1), ValueError, r"warmup must be an int >= 0 .*got -1"),
    (lambda: distopt.DiLoCo(4, None), TypeError, r"outer must be a function .*got NoneType; pass e.g. outer=lambda"),
    (lambda: distopt.DiLoCo(4, torch.optim.SGD(model().parameters(), lr=0.1)), TypeError, r"got SGD; pass e.g. outer="),
    (lambda: distopt.LocalSGD(4, fragments=5), ValueError, r"fragments=5 must be at most every=4"),
    (lambda: distopt.LocalSGD(4, overlap=4), ValueError, r"overlap=4 must be less than every=4.*<= 3"),
    (lambda: distopt.LocalSGD(4, mixing=1.5), ValueError, r"mixing must be in \[0, 1\] .*got 1.5"),
    (lambda: distopt.DiLoCo(4, OUTER, mixing="half"), TypeError, r"mixing must be a number in \[0, 1\], got 'half'"),
])
def test_a_mode_checks_its_own_arguments_naming_the_argument_the_value_and_the_fix(build, error, match) -> None:
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize("mode, kwargs, error, match", [
    (lambda: distopt.LocalSGD(4), {"reduce_op": "sum"}, ValueError,
     r"reduce_op='sum' cannot be combined with mode=LocalSGD\(every=4\): .*use reduce_op='mean'"),
    (lambda: distopt.DiLoCo(4, OUTER), {"bcast_period": 10}, ValueError,
     r"bcast_period=10 cannot be combined with mode=DiLoCo\(every=4, outer=...\): .*use bcast_period=0"),
    (distopt.ShardedState, {"inner": torch.optim.LBFGS}, TypeError, r"mode=ShardedState\(\) cannot shard LBFGS"),
])
def test_a_mode_refuses_the_wrapper_arguments_it_cannot_work_with(mode, kwargs, error, match) -> None:
    inner = kwargs.pop("inner", torch.optim.SGD)
    with pytest.raises(error, match=match):
        DistributedOptimizer(inner(model().parameters(), lr=0.1), mode=mode(), **kwargs)


def test_a_mode_and_a_shorthand_together_are_refused_naming_the_shorthand_to_drop() -> None:
    params = list(model().parameters())
    with pytest.raises(TypeError, match=r"mode=LocalSGD\(every=8\) was given with the shorthand sync_every=4 as "
                                        r"well: .*not both; drop sync_every="):
        DistributedOptimizer(torch.optim.SGD(params, lr=0.1), mode=distopt.LocalSGD(8), sync_every=4)
    with pytest.raises(TypeError, match=r"mode=Synchronous\(\) was given with the shorthand shard_state=True"):
        DistributedOptimizer(torch.optim.SGD(params, lr=0.1), mode=distopt.Synchronous(), shard_state=True)
    with pytest.raises(TypeError, match=r"mode must be a distopt mode, .*got str"):
        DistributedOptimizer(torch.optim.SGD(params, lr=0.1), mode="diloco")
    # A shorthand left at its default is no shorthand given.
    DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), mode=distopt.LocalSGD(8), sync_every=1)


def test_a_mode_object_serves_one_wrapper() -> None:
    mode = distopt.LocalSGD(4)
    first = DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), mode=mode)
    with pytest.raises(ValueError, match=r"mode=LocalSGD\(every=4\) already serves another DistributedOptimizer.*"
                                         r"give each wrapper a mode of its own"):
        DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), mode=mode)
    assert first.mode is mode
    # The shorthands build a mode per wrapper.
    a = DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), sync_every=4)
    b = DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), sync_every=4)
    assert a.mode is not b.mode
    del first
    gc.collect()
    DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), mode=mode)  # its wrapper is gone


def test_ranks_in_modes_with_settings_of_their_own_are_told_the_setting_not_the_mode(monkeypatch) -> None:
    # Rank 0 synchronous, rank 1 in a mode with a setting no shorthand has: every rank names that setting.
    theirs = [({"reduce_op": "mean", "mode": "Synchronous"}, []),
              ({"reduce_op": "mean", "inner_every": 4, "mode": "Hierarchical"}, [])]
    monkeypatch.setattr(checks, "same_everywhere", lambda *args: False)
    monkeypatch.setattr(checks.collectives, "all_gather_object", lambda mine, group=None: theirs)
    for settings, _ in theirs:
        with pytest.raises(ValueError, match=r"different inner_every on different ranks \(rank 0: None, rank 1: 4\)"):
            checks.check_agreement(settings, [], [], None, 0)


# ---------------------------------------------------------------------- a mode at step(), on a fake engine


class World:
    """One rank's wrapper as a mode sees it, over ``create_autospec(GradientEngine)``.

    Each exchange fills one pack with every parameter (what this rank sends is kept in
    :attr:`sent`) and comes back with :attr:`mean` (the other ranks' part of the average), or with
    what this rank sent when it is None.
    """

    def __init__(self, mode: Mode, world_size: int = 2, lr: float = 1.0) -> None:
        self.net = model()
        self.params = list(self.net.parameters())
        self.optimizer = torch.optim.SGD(self.params, lr=lr)
        self.engine = create_autospec(GradientEngine, instance=True)
        self.engine.steps, self.engine.progress, self.engine.world_size = 0, None, world_size
        self.engine.exchange = SimpleNamespace(local=False, fragment_packs=[])
        self.engine.outcome = SimpleNamespace(training=world_size, contributors=world_size)
        self.engine.scale = 1.0 / world_size
        # The modes switch local training through the engine's method; the fake records it where they read it.
        self.engine.keep_gradients_local.side_effect = lambda local: setattr(self.engine.exchange, "local", local)
        self.engine.set_steps.side_effect = lambda steps: setattr(self.engine, "steps", steps)
        self.pack = SimpleNamespace(params=self.params, views=[torch.zeros_like(p) for p in self.params], absent=[], direct=False,
                                    flags=torch.ones(len(self.params)))
        self.engine.packs = [self.pack]
        self.sent: List[List[torch.Tensor]] = []
        self.mean: Optional[List[torch.Tensor]] = None
        self.engine.launch_exchange.side_effect = self._launch
        self.engine.finish_exchange.side_effect = self._finish
        self.reduce_for_step = Mock()
        self.mode = mode
        self.ctx = ModeContext(optimizer=self.optimizer, engine=self.engine, params=self.params, names={},
                               process_group=None, rank=0, root_rank=0, reduce_op="mean",
                               stall_warning=None, stall_timeout=None, reduce_for_step=self.reduce_for_step,
                               synchronize=Mock())
        mode.attach(self.ctx)

    def _launch(self, fill: Callable[[Any], None]) -> None:
        fill(self.pack)
        self.sent.append([v.clone() for v in self.pack.views])

    def _finish(self) -> None:
        if self.mean is not None:
            for view, mean in zip(self.pack.views, self.mean):
                view.copy_(mean)

    def step(self, gradient: float = 1.0) -> None:
        """A step on the gradient ``gradient`` everywhere, as the wrapper takes it."""
        for p in self.params:
            p.grad = torch.full_like(p, gradient)
        self.mode.step(self.ctx, None)
        self.ctx.set_steps(self.ctx.steps + 1)


def test_local_sgd_syncs_every_h_steps_and_nothing_between() -> None:
    world = World(distopt.LocalSGD(every=3))
    launched = []
    for _ in range(9):
        world.step()
        launched.append(world.engine.launch_exchange.call_count)
    assert launched == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    world.engine.keep_gradients_local.assert_called_once_with(True)  # gradients stay local from the start
    world.reduce_for_step.assert_not_called()


def test_local_sgd_takes_the_mean_of_the_parameters_and_sends_the_scaled_pseudo_gradient() -> None:
    world = World(distopt.LocalSGD(every=2))
    start = [p.detach().clone() for p in world.params]
    world.mean = [torch.full_like(p, 0.75) for p in world.params]  # the average of every rank's scaled progress
    world.step(1.0)
    world.step(1.0)
    assert all(torch.equal(sent, torch.full_like(p, 2.0 * 0.5)) for sent, p in zip(world.sent[0], world.params))
    assert all(torch.equal(p.detach(), s - 0.75) for p, s in zip(world.params, start))


def test_local_sgd_is_synchronous_during_its_warmup_then_local() -> None:
    world = World(distopt.LocalSGD(every=2, warmup=2))
    world.engine.keep_gradients_local.assert_called_once_with(False)
    world.step()
    world.step()
    assert world.reduce_for_step.call_count == 2 and world.engine.launch_exchange.call_count == 0
    assert world.engine.keep_gradients_local.call_args.args == (True,) and world.engine.exchange.local is True
    world.step()
    world.step()
    assert world.reduce_for_step.call_count == 2 and world.engine.launch_exchange.call_count == 1


def test_diloco_steps_its_outer_optimizer_on_the_mean_pseudo_gradient() -> None:
    world = World(distopt.DiLoCo(every=2, outer=OUTER))
    start = [p.detach().clone() for p in world.params]
    world.mean = [torch.full_like(p, 3.0) for p in world.params]
    world.step(1.0)
    world.step(1.0)
    # outer SGD, lr 0.5, on the mean pseudo-gradient 3: the anchors and the parameters move by -1.5
    assert all(torch.allclose(p.detach(), s - 1.5) for p, s in zip(world.params, start))
    assert all(torch.equal(a, p.detach()) for (p, a) in world.mode._pairs(world.ctx))


@pytest.mark.parametrize("build", [lambda: distopt.LocalSGD(every=4),
                                   lambda: distopt.DiLoCo(every=2, outer=lambda ps: torch.optim.SGD(
                                       ps, lr=0.5, momentum=0.9))])
def test_a_local_mode_state_dict_round_trips_into_a_fresh_mode(build) -> None:
    world = World(build())
    world.mean = [torch.full_like(p, 0.5) for p in world.params]
    for t in range(3):
        world.step(float(t + 1))
    saved = world.mode.state_dict(world.ctx)
    fresh = World(build())
    fresh.mode.load_state_dict(fresh.ctx, saved)
    again = fresh.mode.state_dict(fresh.ctx)
    assert again[STATE_KEY]["steps"] == saved[STATE_KEY]["steps"] == 3
    assert again[STATE_KEY]["since_sync"] == saved[STATE_KEY]["since_sync"]
    assert all(torch.equal(a, b) for a, b in zip(again[STATE_KEY]["anchors"], saved[STATE_KEY]["anchors"]))
    assert repr(again[STATE_KEY]["outer"]) == repr(saved[STATE_KEY]["outer"])


def test_a_mode_without_a_shorthand_spells_its_arguments_its_own_way_in_errors() -> None:
    message = ""
    try:
        distopt.LocalSGD(4, fragments=9)
    except ValueError as error:
        message = str(error)
    assert "sync_" not in message and re.search(r"fragments=9 must be at most every=4", message)


# ---------------------------------------------------------------------- Islands, in one process


@pytest.mark.parametrize("build, error, match", [
    (lambda: distopt.Islands(across=torch.optim.SGD), TypeError, r"across must be a distopt mode object"),
    (lambda: distopt.Islands(across=distopt.ShardedState()), ValueError,
     r"across=ShardedState\(\) is not supported yet with distopt.Islands: .*pass inside=ShardedState\(\), with "
     r"across=distopt.Synchronous\(\)"),
    (lambda: distopt.Islands(inside="sharded"), TypeError,
     r"Islands\(inside='sharded'\): inside must be a distopt mode object, got str; pass inside=distopt.ShardedState"),
    (lambda: distopt.Islands(inside=distopt.LocalSGD(4)), ValueError,
     r"Islands\(inside=LocalSGD\(every=4\)\): .*LocalSGD, DiLoCo\) goes in across=; pass inside=distopt.ShardedState"),
    (lambda: distopt.Islands(across=distopt.LocalSGD(4, warmup=2)), ValueError,
     r"warmup=2 is not supported yet with distopt.Islands .*pass warmup=0"),
    (lambda: distopt.Islands(islands="0,1"), TypeError, r"islands must be None \(one island per host\), a DeviceMesh"),
    (lambda: distopt.Islands(compression="int3"), ValueError, r"compression must be None, one of"),
])
def test_islands_check_their_own_arguments(build, error, match) -> None:
    with pytest.raises(error, match=match):
        build()


def test_islands_take_the_gradients_sharded_inside_and_say_so_in_their_settings() -> None:
    mode = distopt.Islands(inside=distopt.ShardedState(gradients=True))
    assert mode.inside.gradients and repr(mode) == "Islands(across=Synchronous(), inside=ShardedState(gradients=True))"
    assert mode.settings()["islands_inside"] == "sharded_state(share='in_step', gradients=True)"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"compression": "int8"}, ValueError, r"the wrapper's compression= would compress inside the islands"),
    ({"reduce_op": "sum", "across": distopt.LocalSGD(2)}, ValueError, r"reduce_op='sum' cannot be combined"),
])
def test_islands_refuse_the_wrapper_arguments_they_cannot_work_with_yet(kwargs, error, match) -> None:
    across = kwargs.pop("across", None)
    with pytest.raises(error, match=match):
        DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), mode=distopt.Islands(across), **kwargs)


@pytest.mark.parametrize("across", [None, lambda: distopt.DiLoCo(2, OUTER)])
def test_islands_in_one_process_train_as_the_across_mode_does(across) -> None:
    runs = []
    for mode in (distopt.Islands(across=across and across()), across() if across else distopt.Synchronous()):
        net = model()
        opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode=mode)
        for t in range(5):
            opt.zero_grad()
            net(torch.full((4, 3), float(t))).pow(2).sum().backward()
            opt.step()
        runs.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert repr(distopt.Islands(distopt.LocalSGD(4), islands=[[0, 1], [2, 3]], compression="int8")) == (
        "Islands(across=LocalSGD(every=4), islands=[[0, 1], [2, 3]], compression='int8')")


def test_islands_take_sharded_state_inside_and_say_so_where_shard_state_true_is_given_with_them() -> None:
    assert repr(distopt.Islands(inside=distopt.ShardedState(share="background"))) == (
        "Islands(across=Synchronous(), inside=ShardedState(share='background'))")
    assert distopt.Islands(inside=distopt.Synchronous()).inside is None  # the default, plain replicas, spelled out
    with pytest.raises(TypeError, match=r"shard_state=True as well: pass both in the mode, mode=distopt.Islands\("
                                        r"across=..., inside=distopt.ShardedState\(\)\).*drop shard_state="):
        DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), mode=distopt.Islands(), shard_state=True)
    with pytest.raises(TypeError, match=r"shard_state='gradients' as well: pass both in the mode, .*"
                                        r"inside=distopt.ShardedState\(gradients=True\): the gradients too"):
        DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), mode=distopt.Islands(),
                             shard_state="gradients")
    with pytest.raises(TypeError, match=r"inside=ShardedState\(\) cannot shard LBFGS"):
        DistributedOptimizer(torch.optim.LBFGS(model().parameters()), mode=distopt.Islands(inside=distopt.ShardedState()))


@pytest.mark.parametrize("across", [None, lambda: distopt.DiLoCo(2, OUTER)])
def test_islands_with_sharded_state_inside_in_one_process_train_as_unsharded(across) -> None:
    runs = []
    for inside in (distopt.ShardedState(), None):
        net = model()
        opt = DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=0.1),
                                   mode=distopt.Islands(across=across and across(), inside=inside))
        for t in range(5):
            opt.zero_grad()
            net(torch.full((4, 3), float(t))).pow(2).sum().backward()
            opt.step()
        runs.append([p.detach().clone() for p in net.parameters()])
        if inside is not None:  # a world of one: its shard is the whole state
            assert opt.sharded_state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_islands_refuse_a_closure_saying_what_to_do() -> None:
    net = model()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode=distopt.Islands())
    with pytest.raises(RuntimeError, match=r"step\(closure\) is not supported yet with distopt.Islands"):
        opt.step(lambda: 0.0)


def test_islands_warn_where_a_compressor_of_matrices_cannot_compress_the_flat_slices_across() -> None:
    with pytest.warns(RuntimeWarning, match=r"compression='powersgd' gains nothing across the islands .*'int8'"):
        DistributedOptimizer(torch.optim.SGD(nn.Linear(64, 64).parameters(), lr=0.1),
                             mode=distopt.Islands(compression="powersgd"))
