"""DistributedOptimizer in a single process: the torch.optim surface, and every bad-input error."""
import copy
import warnings

import pytest
import torch
from torch import nn

import distopt
from distopt import DistributedOptimizer


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def train(model, opt, steps=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad"])
def test_single_process_is_bitwise_identical_to_the_inner_optimizer(name):
    plain, wrapped = make_model(), make_model()
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.01}
    train(plain, getattr(torch.optim, name)(plain.parameters(), **kwargs))
    train(wrapped, DistributedOptimizer(getattr(torch.optim, name)(wrapped.parameters(), **kwargs)))
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(a, b)


def test_single_process_installs_no_hooks_and_communicates_nothing():
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.world_size == 1 and opt._engine.handles == []
    train(model, opt, steps=2)
    assert opt.stats.packs == 0 and opt.stats.bytes == 0


def test_constructor_swap_through_distopt_optim_gives_the_same_training():
    plain, swapped = make_model(), make_model()
    train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1))
    opt = distopt.optim.AdamW(swapped.parameters(), lr=1e-2, weight_decay=0.1, pack_threshold=123, bcast_period=7)
    assert isinstance(opt, DistributedOptimizer) and isinstance(opt.optimizer, torch.optim.AdamW)
    assert opt.pack_threshold == 123 and opt.bcast_period == 7
    train(swapped, opt)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), swapped.parameters()))


def test_distopt_optim_covers_every_torch_optimizer():
    names = {n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)}
    names.discard("Optimizer")
    assert set(distopt.optim.__all__) == names
    for name in names:
        assert callable(getattr(distopt.optim, name))


def test_wrapper_is_an_optimizer_and_shares_param_groups_state_and_defaults():
    model = make_model()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = DistributedOptimizer(inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    assert opt.defaults is inner.defaults
    train(model, opt, steps=1)
    assert opt.state is inner.state and len(opt.state) == 4


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=10),
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
    ],
    ids=["StepLR", "OneCycleLR", "ReduceLROnPlateau"],
)
def test_lr_schedulers_drive_the_inner_learning_rate(make_scheduler):
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(inner)
    scheduler = make_scheduler(opt)
    start = inner.param_groups[0]["lr"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for _ in range(4):
            train(model, opt, steps=1)
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(1.0)  # a loss that never improves
            else:
                scheduler.step()
    assert inner.param_groups[0]["lr"] != start


def test_state_dict_has_the_inner_format_and_round_trips_through_a_plain_optimizer():
    model = make_model()
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    train(model, opt, steps=3)
    saved = opt.state_dict()
    plain = torch.optim.AdamW(model.parameters(), lr=0.01)
    plain.load_state_dict(saved)
    assert plain.state_dict()["state"][0]["step"] == saved["state"][0]["step"]
    back_model = copy.deepcopy(model)
    back = DistributedOptimizer(torch.optim.AdamW(back_model.parameters(), lr=0.5))
    back.load_state_dict(plain.state_dict())
    assert back.param_groups[0]["lr"] == 0.01
    assert torch.equal(back.state_dict()["state"][1]["exp_avg"], saved["state"][1]["exp_avg"])


def test_step_hooks_registered_on_the_wrapper_run_on_every_step():
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    train(model, opt, steps=2)
    assert calls == ["pre", "post", "pre", "post"]


def test_lbfgs_with_a_closure_matches_plain_lbfgs():
    def run(wrap):
        model = make_model()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
        opt = DistributedOptimizer(opt) if wrap else opt
        x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(8, 2)

        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(2):
            opt.step(closure)
        return list(model.parameters())

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_add_param_group_puts_new_parameters_under_the_inner_optimizer():
    model, extra = make_model(), nn.Linear(2, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.add_param_group({"params": extra.parameters(), "lr": 0.01})
    assert len(opt.optimizer.param_groups) == 2 and len(opt._params) == 6


# ---------------------------------------------------------------------- bad input


def sgd(model=None):
    return torch.optim.SGD((model or make_model()).parameters(), lr=0.1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"reduce_op": "avg"}, ValueError, r"reduce_op must be 'mean' or 'sum', got 'avg'"),
        ({"pack_threshold": -1}, ValueError, r"pack_threshold must be a number of bytes >= 0.*got -1"),
        ({"pack_threshold": 1.5}, ValueError, r"pack_threshold .* got 1.5"),
        ({"bcast_period": -2}, ValueError, r"bcast_period must be an int >= -1.*got -2"),
        ({"backward_passes_per_step": 0}, ValueError, r"backward_passes_per_step must be an int >= 1.*got 0"),
        ({"compression": "int2"}, ValueError, r"compression must be None, one of 'fp16', .* got 'int2'"),
        ({"root_rank": 1}, ValueError, r"root_rank must be a rank of the process group \(0..0\), got 1"),
        ({"check_every": -1}, ValueError, r"check_every must be an int >= 0 \(N > 0: .* 0: never\), got -1"),
        ({"check_every": 1.5}, TypeError, r"check_every must be an int .*got 1.5; pass e.g. check_every=100"),
        ({"check_every": True}, TypeError, r"check_every must be an int .*got True"),
        ({"drift_atol": -1e-3}, ValueError, r"drift_atol must be a number >= 0 \(0: any difference .*got -0.001"),
        ({"drift_rtol": float("nan")}, ValueError, r"drift_rtol must be a number >= 0 .*got nan"),
        ({"drift_atol": "1e-3"}, TypeError, r"drift_atol must be a number >= 0, got '1e-3'; pass e.g. drift_atol=1e-6"),
        ({"on_drift": "ignore"}, ValueError, r"on_drift must be 'raise' or 'warn', got 'ignore'"),
    ],
)
def test_bad_arguments_raise_naming_the_argument_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedOptimizer(sgd(), **kwargs)


def test_a_non_optimizer_is_a_type_error_that_shows_how_to_build_one():
    with pytest.raises(TypeError, match=r"must be a torch.optim.Optimizer instance, got list.*SGD\(model"):
        DistributedOptimizer([torch.zeros(1)])
    with pytest.raises(TypeError, match="already a DistributedOptimizer"):
        DistributedOptimizer(DistributedOptimizer(sgd()))


def test_named_parameters_must_be_unique_and_cover_every_parameter():
    model = make_model()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match=r"has the name '0.weight' twice"):
        DistributedOptimizer(sgd(model), named_parameters=named + [("0.weight", nn.Parameter(torch.zeros(1)))])
    with pytest.raises(ValueError, match=r"one parameter under two names, '0.weight' and 'alias'"):
        DistributedOptimizer(sgd(model), named_parameters=named + [("alias", named[0][1])])
    with pytest.raises(ValueError, match=r"1 of the optimizer's parameters have no name \(first: param_groups\[0\]\[3\]\)"):
        DistributedOptimizer(sgd(model), named_parameters=named[:3])
    with pytest.raises(ValueError, match=r"\(name, parameter\) pairs"):
        DistributedOptimizer(sgd(model), named_parameters=[p for _, p in named])


def test_the_newest_wrapper_takes_the_parameters_over_and_the_old_one_refuses_to_step():
    model = make_model()
    first = DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    second = DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())  # e.g. a re-run cell
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"step\(\) on a DistributedOptimizer that no longer reduces: a newer "
                                           r"DistributedOptimizer was built over the same parameters"):
        first.step()
    with pytest.raises(RuntimeError, match=r"synchronize\(\) on a DistributedOptimizer that no longer reduces"):
        first.synchronize()
    second.step()
    first.zero_grad()  # harmless
    second.close()
    DistributedOptimizer(sgd(model))  # released by close()


def test_a_dropped_wrapper_is_collected_and_a_closed_one_lets_go_of_its_parameters():
    import gc
    import weakref

    model = make_model()
    first = DistributedOptimizer(sgd(model))
    dropped = weakref.ref(first)
    del first
    gc.collect()
    assert dropped() is None  # neither its hooks nor the parameters keep it alive
    second = DistributedOptimizer(sgd(model))
    assert all(p._distopt_owner() is second for p in model.parameters())
    second.close()
    assert not any(hasattr(p, "_distopt_owner") for p in model.parameters())


def test_the_wrapper_refuses_to_be_pickled_and_says_what_to_save():
    import pickle

    with pytest.raises(TypeError, match=r"save opt.state_dict\(\) instead"):
        pickle.dumps(DistributedOptimizer(sgd()))


def test_hooks_come_back_after_local_steps_on_the_parameters_still_trainable():
    # Local SGD drops the gradient hooks during local steps; going back (a load into the warm-up)
    # re-hooks every parameter it can: one frozen meanwhile cannot take a hook, and must not raise.
    from distopt.engine.engine import GradientEngine
    from distopt.engine.state import EngineConfig

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    params = list(model.parameters())
    engine = GradientEngine(channel=None, config=EngineConfig(op=torch.distributed.ReduceOp.SUM, pack_threshold=0))
    engine.track(params, [str(i) for i in range(len(params))])
    assert len(engine.handles) == 4
    engine.hooks(False)
    assert engine.handles == []
    params[0].requires_grad_(False)
    engine.hooks(True)
    assert len(engine.handles) == 3
