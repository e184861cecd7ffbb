"""The drift check without processes: exact fingerprints, what a difference means, the text, one process."""
import math

import pytest
import torch
from torch import nn

import distopt
from distopt.planning import drift


def kept(*tensors, shared=()):
    return drift.Kept([[(drift.PARAMETER, t)] for t in tensors], list(shared))


def ranks(*kepts, atol=0.0, rtol=0.0, names=None):
    """What :func:`drift.compare` finds between these 'ranks' (one Kept each), as the wrapper runs it."""
    prints = [drift.fingerprints(k) for k in kepts]
    differ = [s for s in range(len(prints[0])) if len({p[s] for p in prints}) > 1]
    everyone = [{s: drift.details(k, s) for s in differ} for k in kepts]
    names = names or [f"p{i}" for i in range(len(kepts[0].per_param))]
    return drift.compare(everyone, names, atol, rtol)


def test_the_same_values_give_the_same_fingerprint_whatever_the_layout_or_thread_count():
    torch.manual_seed(0)
    big = torch.randn(3, 5, 64, 64)
    layouts = [big, big.to(memory_format=torch.channels_last), big.clone().transpose(0, 1).contiguous().transpose(0, 1)]
    odd = torch.randn(11)
    assert len({tuple(drift.fingerprints(kept(t, odd))) for t in layouts}) == 1
    assert drift.fingerprints(kept(torch.randn(12)[1:].copy_(odd))) == drift.fingerprints(kept(odd))  # an offset view
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = drift.fingerprints(kept(big))
        torch.set_num_threads(2)
        assert drift.fingerprints(kept(big)) == one
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("change", ["one ulp", "doubled", "lr doubled", "bf16 ulp", "a state key more"])
def test_any_change_of_the_bits_changes_the_fingerprint(change):
    torch.manual_seed(0)
    w = torch.randn(32, 32)  # 1024 float32 words: doubling moves a 32-bit sum by 1024 * 2**23, 0 modulo 2**32
    h = torch.randn(7, dtype=torch.bfloat16)
    a = kept(w, h, shared=[("param_groups[0]['lr']", 0.01)])
    w2, h2, lr2, extra = w.clone(), h.clone(), 0.01, []
    if change == "one ulp":
        w2[3, 4] = torch.nextafter(w2[3, 4], torch.tensor(math.inf))
    elif change == "doubled":
        w2 *= 2
    elif change == "lr doubled":
        lr2 = 0.02  # its float64 bits move by exactly 2**52
    elif change == "bf16 ulp":
        h2.view(torch.int16)[0] += 1
    else:
        extra = [("optimizer state 'step'", torch.tensor(1.0))]
    b = drift.Kept([[(drift.PARAMETER, w2)] + extra, [(drift.PARAMETER, h2)]], [("param_groups[0]['lr']", lr2)])
    assert drift.fingerprints(a) != drift.fingerprints(b)


def test_a_shift_on_one_rank_drifts_by_the_shift_and_the_tolerance_decides():
    torch.manual_seed(0)
    w = torch.randn(100, dtype=torch.float64)
    shifted = w + 1e-3
    (found,) = ranks(kept(w), kept(shifted))
    assert found.name == "parameter 'p0'" and found.is_parameter and found.beyond
    assert math.isclose(found.drift, 1e-3, rel_tol=1e-9)
    assert "has mean" in found.how and "on rank 1" in found.how
    (tolerated,) = ranks(kept(w), kept(shifted), atol=2e-3)
    assert not tolerated.beyond and math.isclose(tolerated.drift, 1e-3, rel_tol=1e-9)
    (relative,) = ranks(kept(w), kept(shifted), rtol=2e-3 / w.square().mean().sqrt().item())
    assert not relative.beyond
    (beyond,) = ranks(kept(w), kept(shifted), atol=5e-4)
    assert beyond.beyond


def test_bits_that_differ_with_equal_moments_count_only_without_a_tolerance():
    zeros, negative = torch.zeros(4), torch.zeros(4)
    negative[0] = -0.0
    (found,) = ranks(kept(zeros), kept(negative))
    assert found.drift == 0 and found.beyond and "differs in its bits only" in found.how
    (tolerated,) = ranks(kept(zeros), kept(negative), atol=1e-12)
    assert not tolerated.beyond


def test_a_nan_a_missing_entry_or_another_shape_is_infinite_drift_beyond_any_tolerance():
    w = torch.ones(3)
    nan = w.clone()
    nan[1] = math.nan
    (found,) = ranks(kept(w), kept(nan), atol=1e9)
    assert found.drift == math.inf and found.beyond
    with_state = drift.Kept([[(drift.PARAMETER, w), ("optimizer state 'exp_avg'", torch.zeros(3))]])
    (missing,) = ranks(with_state, kept(w), atol=1e9)
    assert missing.name == "optimizer state 'exp_avg' of 'p0'" and missing.how == "exists on rank 0 but not on rank 1"
    (shape,) = ranks(kept(w), kept(torch.ones(4)), atol=1e9)
    assert shape.how == "is a tensor of shape [3] float32 on rank 0, a tensor of shape [4] float32 on rank 1"


def test_the_text_names_the_first_difference_its_size_the_likely_cause_and_what_the_rebroadcast_did():
    w = torch.zeros(8, dtype=torch.float64)
    a = drift.Kept([[(drift.PARAMETER, w)], [(drift.PARAMETER, w)]], [("param_groups[0]['lr']", 0.1)], what="X")
    b = drift.Kept([[(drift.PARAMETER, w)], [(drift.PARAMETER, w + 0.5)]], [("param_groups[0]['lr']", 0.2)], what="X")
    report = drift.DriftReport(step=6, compared=a.compared, drifted=ranks(a, b, names=["a", "b"]), what="X",
                               corrected=0.5)
    assert [d.name for d in report.beyond] == ["parameter 'b'", "param_groups[0]['lr']"]
    text = drift.message(report, when="right before the re-broadcast after step 6", atol=0.0, rtol=0.0,
                         on_drift="raise", root=0, bcast_period=3)
    assert text.startswith("the ranks drifted apart: parameter 'b' differs between ranks by 0.5: it has mean "
                           "0 on rank 0, 0.5 on rank 1; RMS 0 on rank 0, 0.5 on rank 1, beyond the tolerance")
    assert "Perhaps the cause: param_groups[0]['lr'] is 0.1 on rank 0, 0.2 on rank 1" in text
    assert ("That re-broadcast (bcast_period=3) then gave every rank rank 0's parameters: it corrected a parameter "
            "drift of 0.5; it does not send the rest") in text
    assert text.endswith("or pass on_drift='warn' to be warned and train on")


def test_in_one_process_check_drift_compares_nothing_and_the_defaults_are_on_and_exact():
    model = nn.Linear(3, 2)
    opt = distopt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert (opt.check_every, opt.drift_atol, opt.drift_rtol, opt.on_drift) == (100, 0.0, 0.0, "raise")
    report = opt.check_drift()
    assert isinstance(report, distopt.DriftReport) and report.drifted == [] and report.drift == 0.0
    stats = opt.stats
    assert (stats.drift_checks, stats.drifted, stats.drift, stats.drift_name, stats.drift_corrected) == (0, 0, 0.0, "", None)
