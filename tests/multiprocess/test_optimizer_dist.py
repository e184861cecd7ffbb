"""DistributedOptimizer across real processes (gloo over 127.0.0.1).

Each check is a module-level function that runs on every rank and returns what
it measured, compared against a single-process reference computed inside the
worker; the assertions live in the tests. Starting a rank costs seconds (torch
and torch._dynamo imports), so one world per world size runs every check once
(``world`` fixture) and each test reads its check's results. A check that raises
reports its traceback to its own test only.
"""
import math
import random
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt import DistributedOptimizer
from distopt.planning.control import CONTROL_FLAGS

from _worlds import Worlds

pytestmark = pytest.mark.timeout(300)  # the first test of a world pays for starting it

BATCH = 12  # divisible by every world size tested
TOL = 1e-10


def world_results(world, fn, *args):
    """Per-rank results of ``fn(*args)``, from the one run of every check registered for ``world``."""
    return WORLDS.results(_check_name(world, fn, args))


def _check_name(world, fn, args):
    return f"{fn.__name__}{args!r}, world {world}"


def rank_world():
    return dist.get_rank(), dist.get_world_size()


def make_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def batches(steps, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 5, generator=g, dtype=dtype), torch.randn(BATCH, 3, generator=g, dtype=dtype)) for _ in range(steps)]


def shard(t):
    rank, world = rank_world()
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def max_diff(a, b):
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def same_on_all_ranks(params):
    mine = [p.detach().clone() for p in params]
    everyone = distopt.collectives.all_gather_object(mine)
    return all(torch.equal(a, b) for other in everyone for a, b in zip(mine, other))


# ---------------------------------------------------------------------- parity


def parity_worker():
    results = {}
    data = batches(6)
    optimizers = {
        "SGD+momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    }
    for opt_name, make_opt in optimizers.items():
        reference = make_model()
        ref_opt = make_opt(reference.parameters())
        for x, y in data:
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
        for threshold in (1, distopt.wrapper.DEFAULT_PACK_THRESHOLD, 10**9):
            model = make_model(seed=rank_world()[0])  # different start: the construction broadcast aligns them
            opt = DistributedOptimizer(make_opt(model.parameters()), pack_threshold=threshold)
            for x, y in data:
                opt.zero_grad()
                nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
                opt.step()
            results[(opt_name, threshold)] = max_diff(model.parameters(), reference.parameters())
            opt.close()
    return results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_training_matches_single_process_training_on_the_whole_batch(world):
    for rank_results in world_results(world, parity_worker):
        for case, diff in rank_results.items():
            assert diff < TOL, (case, diff)


def ddp_parity_worker():
    from torch.nn.parallel import DistributedDataParallel

    ddp_model = DistributedDataParallel(make_model())
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    model = make_model()
    opt = distopt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, pack_threshold=200)
    for x, y in batches(6):
        for m, o in ((ddp_model, ddp_opt), (model, opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(shard(x)), shard(y)).backward()
            o.step()
    return max_diff(model.parameters(), ddp_model.module.parameters())


def test_training_matches_pytorch_ddp_on_the_same_data():
    assert all(diff < TOL for diff in world_results(2, ddp_parity_worker))


# ---------------------------------------------------------------------- randomized reduction


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DTYPE_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def case_grad(case, rnd, rank, index, shape, dtype):
    g = torch.Generator().manual_seed(hash((case, rnd, rank, index)) % 2**31)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def random_reduction_worker(cases):
    rank, world = rank_world()
    failures = []
    for case in range(cases):
        rng = random.Random(case)  # the same parameter set on every rank
        n = rng.randint(1, 10)
        specs = [(tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 2))), rng.choice(DTYPES)) for _ in range(n)]
        threshold = rng.choice([0, 1, 16, 100, 10**9])
        params = [torch.zeros(shape, dtype=dtype, requires_grad=True) for shape, dtype in specs]
        opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), pack_threshold=threshold)
        for rnd in range(3):
            # Which parameters each rank uses, and in what order, differs by rank and round.
            used = {r: [i for i in range(n) if random.Random(hash((case, rnd, r))).random() < 0.7 or n == 1] for r in range(world)}
            order = list(used[rank])
            random.Random(f"{case}-{rnd}-{rank}-order").shuffle(order)  # str seeds: the same in every run
            anchor = torch.zeros((), requires_grad=True)  # backward must run even with nothing used
            loss = anchor * 0
            for i in order:
                loss = loss + (params[i] * case_grad(case, rnd, rank, i, *specs[i])).sum().double()
            opt.zero_grad()
            plan_was_fixed = opt._engine.planned  # the first round may re-plan, changing the pack count
            loss.backward()
            opt.synchronize()
            for i, (shape, dtype) in enumerate(specs):
                users = [r for r in range(world) if i in used[r]]
                got = params[i].grad
                if not users:
                    if got is not None:
                        failures.append(f"case {case} round {rnd}: param {i} used on no rank has a gradient")
                    continue
                expected = sum(case_grad(case, rnd, r, i, shape, torch.float64) for r in users) / world
                if got is None or got.dtype != dtype or got.shape != torch.Size(shape):
                    failures.append(f"case {case} round {rnd}: param {i} gradient is {got!r}")
                elif not torch.allclose(got.double(), expected, rtol=DTYPE_TOL[dtype], atol=DTYPE_TOL[dtype]):
                    failures.append(f"case {case} round {rnd}: param {i} ({dtype}) {got} != {expected}")
            if plan_was_fixed and opt.stats.packs != len(opt._engine.packs):
                failures.append(f"case {case} round {rnd}: {opt.stats.packs} all-reduces for {len(opt._engine.packs)} packs")
            opt.step()
        for pack in opt._engine.packs:
            if len({(params[i].dtype, params[i].device) for i in pack.spec.members}) != 1:
                failures.append(f"case {case}: a pack mixes dtypes or devices")
        opt.close()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_random_parameter_sets_get_every_gradient_averaged_exactly_once(world):
    for failures in world_results(world, random_reduction_worker, 30):
        assert failures == []


# ---------------------------------------------------------------------- control flow


class Branchy(nn.Module):
    """``only_rank1`` is used on rank 1 only; ``nowhere`` is never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(5, 3).double()
        self.only_rank1 = nn.Linear(3, 3).double()
        self.nowhere = nn.Linear(3, 3).double()

    def forward(self, x, rank):
        h = self.body(x)
        return self.only_rank1(h) if rank == 1 else h


def unused_parameters_worker():
    rank, world = rank_world()
    model = Branchy()
    plain = Branchy()  # computes this rank's local gradients for the reference
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    report = []
    for x, y in batches(4):
        plain.load_state_dict(model.state_dict())
        plain.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(shard(x), rank), shard(y)).backward()
        local = {n: (None if p.grad is None else p.grad.clone()) for n, p in plain.named_parameters()}
        everyone = distopt.collectives.all_gather_object(local)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x), rank), shard(y)).backward()
        for name, p in model.named_parameters():
            grads = [g[name] for g in everyone if g[name] is not None]
            expected = None if not grads else sum(grads) / world
            if expected is None:
                report.append(p.grad is None)
            else:
                report.append(p.grad is not None and (p.grad - expected).abs().max().item() < TOL)
        opt.step()
    return all(report), same_on_all_ranks(model.parameters()), model.nowhere.weight.grad is None


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_unused_on_some_ranks_average_with_zeros_and_unused_everywhere_stay_none(world):
    for grads_ok, in_step, nowhere_none in world_results(world, unused_parameters_worker):
        assert grads_ok and in_step and nowhere_none


# ---------------------------------------------------------------------- periodic broadcast


def bcast_period_worker(period):
    rank, _ = rank_world()
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), bcast_period=period)
    if rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1.0)  # drift that only a broadcast can undo
    agree = []
    for x, y in batches(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
        opt.step()
        agree.append(same_on_all_ranks(model.parameters()))
    return agree


def test_bcast_period_realigns_drifted_ranks_after_every_nth_step():
    assert world_results(2, bcast_period_worker, 3) == [[False, False, True, True]] * 2


def bcast_schedule_worker(period, passes):
    """Rank 1 drifts before every step; whether the ranks agree after each of 9 steps (of ``passes``
    backward passes each) says exactly after which steps the parameters were re-broadcast."""
    rank, _ = rank_world()
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), bcast_period=period,
                               backward_passes_per_step=passes)
    agree = []
    for x, y in batches(9):
        opt.zero_grad()
        if rank == 1:
            with torch.no_grad():
                model[0].weight.add_(0.5)
        for part in range(passes):
            nn.functional.mse_loss(model(shard(x))[part::passes], shard(y)[part::passes]).backward()
        opt.step()
        agree.append(same_on_all_ranks(model.parameters()))
    return agree


@pytest.mark.parametrize("period, passes", [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2)])
def test_bcast_period_rebroadcasts_after_exactly_every_nth_step_counting_steps_not_passes(period, passes):
    expected = [step % period == 0 for step in range(1, 10)]
    assert world_results(2, bcast_schedule_worker, period, passes) == [expected] * 2


def test_bcast_period_minus_one_never_broadcasts():
    assert world_results(2, bcast_period_worker, -1) == [[False] * 4] * 2


# ---------------------------------------------------------------------- the drift check

#: Per case: the wrapper's drift settings, and what rank 1 alone changes before step 1's backward
#: (``"param"``: ``4.bias += 1e-3``; ``"lr"``: its learning rate doubled; ``"state"``: Adam's ``exp_avg`` of
#: ``4.bias`` += 1e-3 right after step 1, then ``check_drift()``; None: nothing).
DRIFT_CASES = {
    "identical": ({"check_every": 2}, None),
    "param": ({"check_every": 2}, "param"),
    "lr": ({"check_every": 2}, "lr"),
    "state": ({"check_every": 2}, "state"),
    "warn": ({"check_every": 2, "on_drift": "warn"}, "param"),
    "tolerated": ({"check_every": 2, "drift_atol": 1e-2}, "param"),
    "bcast": ({"check_every": 1, "bcast_period": 3, "on_drift": "warn"}, "param"),
}


def drift_worker(case):
    """Six Adam steps under the drift check; returns the stats after each step, the warnings, and the
    error (its text and report) if one was raised."""
    rank, _ = rank_world()
    settings, change = DRIFT_CASES[case]
    model = make_model()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), **settings)
    out = {"stats": [], "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step, (x, y) in enumerate(batches(6)):
                if step == 1 and rank == 1 and change in ("param", "lr"):
                    with torch.no_grad():
                        if change == "param":
                            model[4].bias.add_(1e-3)
                        else:
                            opt.param_groups[0]["lr"] *= 2
                opt.zero_grad()
                nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
                opt.step()
                s = opt.stats
                out["stats"].append((s.drift_checks, s.drift_step, s.drifted, s.drift, s.drift_name, s.drift_corrected))
                if step == 1 and change == "state":
                    if rank == 1:
                        opt.optimizer.state[model[4].bias]["exp_avg"].add_(1e-3)
                    opt.check_drift()
            report = opt.check_drift() if not caught else None
            out["manual"] = None if report is None else (report.drifted, report.compared, opt.stats.drift_checks,
                                                         len(opt.param_groups[0]) - 1)
        except distopt.DriftError as e:
            out["error"] = (str(e), e.report.drift, [d.name for d in e.report.beyond])
            s = opt.stats
            out["stats"].append((s.drift_checks, s.drift_step, s.drifted, s.drift, s.drift_name, s.drift_corrected))
    out["warnings"] = [(w.category.__name__, str(w.message), w.filename) for w in caught]
    out["same"] = same_on_all_ranks(model.parameters())
    return out


def test_identical_ranks_pass_every_drift_check_and_stats_say_zero_drift():
    for r in world_results(2, drift_worker, "identical"):
        assert r["error"] is None and r["warnings"] == []
        assert [s[:5] for s in r["stats"]] == [(c, 2 * c, 0, 0.0, "") for c in (0, 1, 1, 2, 2, 3)]
        drifted, compared, checks, hyperparameters = r["manual"]
        # 6 parameters with Adam's exp_avg, exp_avg_sq and step each; the hyperparameters; the step count
        assert drifted == [] and compared == 6 * 4 + hyperparameters + 1 and checks == 4


def test_a_parameter_perturbed_on_one_rank_is_the_same_error_on_every_rank_naming_it_and_the_size():
    results = world_results(2, drift_worker, "param")
    assert results[0]["error"][0] == results[1]["error"][0]
    for r in results:
        text, drift, beyond = r["error"]
        assert re.search(r"parameter '4.bias' differs between ranks by 0.001: it has mean .* on rank 0, .* on rank 1; "
                         r"RMS .*beyond the tolerance drift_atol=0 \+ drift_rtol=0.*after step 2 \(check_every=2\)"
                         r".*on_drift='warn'", text)
        assert beyond == ["parameter '4.bias'"] and math.isclose(drift, 1e-3, rel_tol=1e-9)
        # The check ran after step 2 (the step itself was taken), and stats hold what it found.
        assert r["stats"][-1][:3] == (1, 2, 1) and r["stats"][-1][4] == "parameter '4.bias'"


def test_a_learning_rate_changed_on_one_rank_is_named_as_the_likely_cause():
    results = world_results(2, drift_worker, "lr")
    assert results[0]["error"][0] == results[1]["error"][0]
    text = results[0]["error"][0]
    assert "parameter '0.weight' differs between ranks" in text
    assert "Perhaps the cause: param_groups[0]['lr'] is 0.01 on rank 0, 0.02 on rank 1" in text


def test_optimizer_state_perturbed_on_one_rank_is_named_by_check_drift():
    results = world_results(2, drift_worker, "state")
    assert results[0]["error"][0] == results[1]["error"][0]
    text, drift, beyond = results[0]["error"]
    assert beyond == ["optimizer state 'exp_avg' of '4.bias'"] and math.isclose(drift, 1e-3, rel_tol=1e-6)
    assert "called as opt.check_drift() after step 2" in text


def test_warn_mode_warns_at_every_check_and_training_goes_on():
    for r in world_results(2, drift_worker, "warn"):
        assert r["error"] is None and len(r["stats"]) == 6
        assert [w[0] for w in r["warnings"]] == ["DriftWarning"] * 3  # steps 2, 4 and 6: the drift stays
        assert "parameter '4.bias' differs between ranks by 0.001" in r["warnings"][0][1]
        assert "on_drift='warn'" not in r["warnings"][0][1]
        assert r["warnings"][0][2] == __file__  # points at the user's opt.step()


def test_a_drift_within_the_tolerance_is_reported_in_stats_and_not_raised():
    for r in world_results(2, drift_worker, "tolerated"):
        assert r["error"] is None and r["warnings"] == []
        checks, step, drifted, drift, name, _ = r["stats"][-1]
        assert (checks, step, drifted, name) == (3, 6, 1, "parameter '4.bias'") and math.isclose(drift, 1e-3, rel_tol=1e-9)


def test_with_bcast_period_the_check_runs_before_the_rebroadcast_and_says_what_it_corrected():
    for r in world_results(2, drift_worker, "bcast"):
        # check_every=1, but with bcast_period the checks run right before the re-broadcasts (steps 3 and 6).
        assert [s[0] for s in r["stats"]] == [0, 0, 1, 1, 1, 2]
        corrected = [s[5] for s in r["stats"]]
        assert corrected[:2] == [None, None] and math.isclose(corrected[2], 1e-3, rel_tol=1e-9)
        assert corrected[5] == 0.0  # the ranks agreed by step 6: nothing left to correct
        (warning,) = r["warnings"]
        assert ("right before the re-broadcast after step 3" in warning[1]
                and "gave every rank rank 0's parameters: it corrected a parameter drift of 0.001" in warning[1])
        assert r["same"]


# ---------------------------------------------------------------------- accumulation and no_sync


def accumulation_worker(mode):
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    model = make_model()
    passes = 2 if mode == "backward_passes_per_step" else 1
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), backward_passes_per_step=passes)
    data = batches(6)
    packs_after_first = []
    for (x1, y1), (x2, y2) in zip(data[0::2], data[1::2]):
        ref_opt.zero_grad()
        (nn.functional.mse_loss(reference(x1), y1) + nn.functional.mse_loss(reference(x2), y2)).backward()
        ref_opt.step()
        opt.zero_grad()
        if mode == "no_sync":
            with opt.no_sync():
                nn.functional.mse_loss(model(shard(x1)), shard(y1)).backward()
        else:
            nn.functional.mse_loss(model(shard(x1)), shard(y1)).backward()
        packs_after_first.append(opt._engine.state)
        nn.functional.mse_loss(model(shard(x2)), shard(y2)).backward()
        opt.step()
    error = ""
    opt.zero_grad()
    for x, y in data[: passes + 1]:
        try:
            nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
        except RuntimeError as e:
            error = str(e)
    return max_diff(model.parameters(), reference.parameters()), packs_after_first, error


@pytest.mark.parametrize("mode", ["backward_passes_per_step", "no_sync"])
def test_accumulated_gradients_are_reduced_once_on_the_last_pass(mode):
    for diff, states, error in world_results(2, accumulation_worker, mode):
        assert diff < TOL
        assert states == [distopt.engine.RoundState.OPEN] * 3  # nothing was reduced after the first pass
        assert "call step() or zero_grad() before the next backward()" in error


# ---------------------------------------------------------------------- clipping and GradScaler


def scaler_worker():
    reference = make_model(dtype=torch.float32)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model = make_model(dtype=torch.float32)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), pack_threshold=500)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    launches = []
    for x, y in batches(5, dtype=torch.float32):
        ref_opt.zero_grad()
        ref_scaler.scale(nn.functional.mse_loss(reference(x), y)).backward()
        ref_scaler.unscale_(ref_opt)
        nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        ref_scaler.step(ref_opt)
        ref_scaler.update()

        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(shard(x)), shard(y))).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        packs = opt.stats.packs
        scaler.step(opt)
        scaler.update()
        launches.append((packs, opt.stats.packs, len(opt._engine.packs)))
    return max_diff(model.parameters(), reference.parameters()), launches


def test_synchronize_clipping_and_grad_scaler_reduce_exactly_once():
    for diff, launches in world_results(2, scaler_worker):
        assert diff < 1e-5  # float32
        for before_step, after_step, packs in launches:
            assert before_step == after_step == packs


# ---------------------------------------------------------------------- construction checks


def mismatch_worker():
    rank, _ = rank_world()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 9 if rank == 1 else 2))
    try:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_models_all_fail_at_construction_naming_the_parameter():
    for message in world_results(2, mismatch_worker):
        assert "parameter 2 ('1.weight') is shape [2, 8] torch.float32 on rank 0 but shape [9, 8]" in message


# ---------------------------------------------------------------------- other optimizers and state


def lbfgs_worker(line_search_fn=None, tolerance_change=1e-9):
    settings = dict(lr=0.5, max_iter=4 if line_search_fn is None else 10, line_search_fn=line_search_fn,
                    tolerance_change=tolerance_change)
    reference, model = make_model(), make_model()
    ref_opt = torch.optim.LBFGS(reference.parameters(), **settings)
    opt = DistributedOptimizer(torch.optim.LBFGS(model.parameters(), **settings), pack_threshold=300)
    losses = []
    for x, y in batches(3):
        def ref_closure():
            ref_opt.zero_grad()
            loss = nn.functional.mse_loss(reference(x), y)
            loss.backward()
            return loss

        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(shard(x)), shard(y))
            loss.backward()
            return loss

        losses.append((ref_opt.step(ref_closure).item(), opt.step(closure).item()))
    return max_diff(model.parameters(), reference.parameters()), losses


def test_lbfgs_with_a_closure_matches_single_process_lbfgs():
    assert all(diff < 1e-8 for diff, _ in world_results(2, lbfgs_worker))


@pytest.mark.parametrize("line_search_fn, tolerance_change", [("strong_wolfe", 1e-9), (None, 1e-3)])
def test_lbfgs_line_search_and_stopping_read_the_mean_loss_so_every_rank_steps_alike(line_search_fn,
                                                                                    tolerance_change):
    # Both read the loss the closure returns: with each rank's own, the ranks stepped apart.
    for diff, losses in world_results(2, lbfgs_worker, line_search_fn, tolerance_change):
        assert diff < 1e-8
        assert all(abs(ref - mine) < 1e-10 for ref, mine in losses)  # step() returns the full batch's loss


def optimizer_state_worker():
    rank, _ = rank_world()
    model = make_model()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    if rank == 0:  # as if only the root loaded a checkpoint
        x, y = batches(1)[0]
        with opt.no_sync():  # a local backward: the other rank takes no part
            nn.functional.mse_loss(model(x), y).backward()
        opt.optimizer.step()
        opt.optimizer.zero_grad()
    before = {k: v.clone() for k, v in opt.state_dict()["state"].get(0, {}).items()}
    opt.broadcast_optimizer_state()
    opt.broadcast_parameters()
    state = opt.state_dict()["state"]
    everyone = distopt.collectives.all_gather_object({k: v for k, v in state[0].items()})
    return all(torch.equal(everyone[0][k], other[k]) for other in everyone for k in everyone[0]), (
        rank != 0 or all(torch.equal(before[k], state[0][k]) for k in before)
    ), same_on_all_ranks(model.parameters())


def test_broadcast_optimizer_state_gives_every_rank_the_roots_state_unchanged():
    for equal, root_unchanged, params_equal in world_results(2, optimizer_state_worker):
        assert equal and root_unchanged and params_equal


def sparse_worker(sparse_as_dense):
    rank, _ = rank_world()
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True).double()
    opt = DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), sparse_as_dense=sparse_as_dense)
    try:
        emb(torch.tensor([rank, 5])).sum().backward()
    except RuntimeError as e:
        return str(e)
    opt.step()
    return emb.weight.grad.tolist()


def test_sparse_gradients_are_rejected_with_the_fix_or_reduced_dense_when_asked():
    for message in world_results(2, sparse_worker, False):
        assert "has a sparse gradient" in message and "sparse_as_dense=True" in message
    grads = world_results(2, sparse_worker, True)
    expected = [[0.5] * 3, [0.5] * 3] + [[0.0] * 3] * 3 + [[1.0] * 3] + [[0.0] * 3] * 4
    assert grads == [expected, expected]


# ---------------------------------------------------------------------- compression


def compression_worker(compression):
    rank, world = rank_world()
    params = [torch.zeros(1000, requires_grad=True), torch.zeros(7, dtype=torch.float64, requires_grad=True)]
    opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), compression=compression)
    big = torch.full((1000,), 40000.0 * (rank + 1))  # the sum, 120000, would overflow fp16 without pre-scaling
    loss = (params[0] * big).sum() + (params[1] * (rank + 1)).sum()
    loss.backward()
    return params[0].grad[0].item(), params[1].grad[0].item(), opt.stats.bytes


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_sends_16_bits_and_scales_the_mean_before_the_cast(compression):
    for big, small, nbytes in world_results(2, compression_worker, compression):
        assert big == pytest.approx(60000.0, rel=1e-2)
        assert small == pytest.approx(1.5, rel=1e-2)
        flags = 1 + CONTROL_FLAGS  # per pack of one member: its presence flag and the control flags
        assert nbytes == (1000 + flags + 7 + flags) * 2  # both packs 16-bit on the wire, flags included


# ---------------------------------------------------------------------- plan


def plan_worker():
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pack_threshold=1)
    planned = []
    for x, y in batches(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
        opt.step()
        planned.append((opt._engine.planned, opt.stats.packs_at_flush))
    return planned, [pack.spec.members for pack in opt._engine.packs]


def test_the_roots_observed_order_becomes_the_fixed_plan_and_packs_overlap_backward():
    (planned, plan), (planned1, plan1) = world_results(2, plan_worker)
    assert plan == plan1
    assert [p for p, _ in planned] == [True, True, True]
    # Biases get their gradient before weights here, so the order differs from reverse registration.
    assert plan[0] == (5,) and plan[1] == (4,)
    assert all(at_flush == 0 for _, at_flush in planned[1:])


def overlap_worker():
    """A model of several packs of several members: which packs launch, in which order, and how many had
    launched when the first layer's weight gradient (one of the last of backward) was computed."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]).double()  # 2176 bytes a layer
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pack_threshold=4000)
    engine = opt._engine
    launches, before_end = [], []
    launch = engine._launch
    engine._launch = lambda index: (launches.append(index), launch(index))
    model[0].weight.register_hook(lambda grad: before_end.append(engine.launch_order.launched))
    rounds = []
    for x, _ in batches(3):
        opt.zero_grad()
        launches.clear()
        before_end.clear()
        model(shard(torch.randn(BATCH, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))))\
            .sum().backward()
        rounds.append((list(launches), list(before_end), opt.stats.packs, opt.stats.packs_at_flush))
        opt.step()
    return rounds, [list(pack.spec.members) for pack in engine.packs]


def test_packs_of_several_members_launch_in_plan_order_while_backward_still_runs():
    for rounds, plan in world_results(2, overlap_worker):
        # 6 layers of 2048 + 128 bytes at a 4000-byte threshold: a pack closes every two layers.
        assert [len(members) for members in plan] == [4, 4, 4], plan
        for launches, before_end, packs_sent, at_flush in rounds[1:]:  # the plan is fixed after the first round
            assert launches == list(range(len(plan)))  # every pack once, in plan order
            assert packs_sent == len(plan) and at_flush <= 1
            # When the first layer's weight gradient was computed, every pack without a member of the
            # first layer had launched already: the sends overlap the rest of backward.
            assert before_end == [len(plan) - 1], (before_end, plan)


def dropped_wrapper_worker():
    """What a dropped wrapper leaves behind at world 2, where it hooks every parameter and holds a group."""
    import gc
    import weakref

    model = make_model()
    hooks_before = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    hooked = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    x, y = batches(1)[0]
    nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
    opt.step()
    engine, dropped = weakref.ref(opt._engine), weakref.ref(opt)
    was_enabled = gc.isenabled()
    gc.disable()  # freed by reference counting alone: no cycle keeps it (or its hooks' engine) alive
    try:
        del opt
        freed = dropped() is None and engine() is None
    finally:
        if was_enabled:
            gc.enable()
    hooks_after = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    nn.functional.mse_loss(model(shard(x)), shard(y)).backward()  # nothing reduces it, nothing raises
    return freed, hooks_before, hooked, hooks_after


def test_a_mode_opens_an_engine_over_a_subgroup_that_averages_over_that_group_alone():
    results = world_results(3, mode_engine_worker)
    pair = results[:2]
    for r in pair:
        assert r["world"] == 2 and r["hooks"] == 0 and r["packs"] >= 2  # its own packs, no gradient hook
        assert torch.allclose(r["means"]["a"], torch.full((10,), 1.5, dtype=torch.float64), rtol=0, atol=TOL)
        assert torch.allclose(r["means"]["b"], torch.arange(30, dtype=torch.float64) * 1.5, rtol=0, atol=TOL)
        assert r["params_alike"]  # the wrapper's engine averaged over every rank meanwhile
    assert results[2]["world"] == 1 and results[2]["means"] is None and results[2]["params_alike"]


def test_a_dropped_wrapper_is_freed_at_once_and_removes_its_hooks():
    for freed, before, hooked, after in world_results(2, dropped_wrapper_worker):
        assert freed
        assert hooked == [b + 1 for b in before] and after == before


# ---------------------------------------------------------------------- activation checkpointing


def checkpoint_worker(reentrant):
    from torch.utils.checkpoint import checkpoint

    reference, model = make_model(), make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), pack_threshold=1)
    for x, y in batches(3):
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        # Checkpointing the last layers puts the first gradients inside the recomputation.
        out = checkpoint(model[3:], model[:3](shard(x)), use_reentrant=reentrant)
        try:
            nn.functional.mse_loss(out, shard(y)).backward()
        except RuntimeError as e:
            return str(e)
        opt.step()
    return max_diff(model.parameters(), reference.parameters())


def test_non_reentrant_checkpointing_trains_like_single_process():
    assert all(diff < TOL for diff in world_results(2, checkpoint_worker, False))


def test_reentrant_checkpointing_fails_loudly_and_names_the_fix():
    for message in world_results(2, checkpoint_worker, True):
        assert "use_reentrant=False" in message


def mode_engine_worker():
    """A mode's second engine over a subgroup (ModeContext.open_engine): ranks 0 and 1 average through
    its packs over their group alone, rank 2 is a group of one, and the wrapper's own engine trains on."""
    rank, world = rank_world()
    islands = [[0, 1], [2]]
    groups = [dist.new_group(ranks) for ranks in islands]  # every rank creates every group, in order
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pack_threshold=64)
    engine = opt._context.open_engine(groups[0 if rank < 2 else 1])
    values = [torch.full((10,), float(rank + 1), dtype=torch.float64, requires_grad=True),
              (torch.arange(30, dtype=torch.float64) * (rank + 1)).requires_grad_()]
    engine.track(values, ["a", "b"])

    def fill(pack):
        for j, (p, view) in enumerate(zip(pack.params, pack.views)):
            view.copy_(p.detach() if engine.scale is None else p.detach() * engine.scale)

    exchanging = engine.world_size > 1  # a group of one has nothing to average: no channel
    if exchanging:
        engine.launch_exchange(fill)
    x, y = batches(1)[0]  # the wrapper's own round, while the mode's exchange is in flight
    opt.zero_grad()
    nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
    opt.step()
    means = None
    if exchanging:
        engine.finish_exchange()
        means = {name: view.clone() for pack in engine.packs
                 for name, view in zip([engine.names[i] for i in pack.spec.members], pack.views)}
    result = {"world": engine.world_size, "hooks": len(engine.handles), "packs": len(engine.packs),
              "means": means, "params_alike": same_on_all_ranks(list(model.parameters()))}
    engine.close()
    opt.close()
    return result


# (worlds, check, args): every check the world fixture runs, in order.
CHECKS = [
    ((1, 2, 3), parity_worker, ()),
    ((2,), ddp_parity_worker, ()),
    ((2, 3), random_reduction_worker, (30,)),
    ((2, 3), unused_parameters_worker, ()),
    ((2,), bcast_period_worker, (3,)),
    ((2,), bcast_period_worker, (-1,)),
    *[((2,), bcast_schedule_worker, (period, passes)) for period, passes in [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2)]],
    ((2,), accumulation_worker, ("backward_passes_per_step",)),
    ((2,), accumulation_worker, ("no_sync",)),
    ((2,), scaler_worker, ()),
    ((2,), mismatch_worker, ()),
    ((2,), lbfgs_worker, ()),
    ((2,), lbfgs_worker, ("strong_wolfe", 1e-9)),
    ((2,), lbfgs_worker, (None, 1e-3)),
    ((2,), optimizer_state_worker, ()),
    ((2,), sparse_worker, (False,)),
    ((2,), sparse_worker, (True,)),
    ((2,), compression_worker, ("fp16",)),
    ((2,), compression_worker, ("bf16",)),
    ((2,), plan_worker, ()),
    ((2,), overlap_worker, ()),
    ((2,), dropped_wrapper_worker, ()),
    ((3,), mode_engine_worker, ()),
    ((2,), checkpoint_worker, (False,)),
    ((2,), checkpoint_worker, (True,)),
    *[((2,), drift_worker, (case,)) for case in DRIFT_CASES],
]
WORLDS = Worlds({_check_name(w, fn, args): (w, fn, args) for worlds, fn, args in CHECKS for w in worlds})
