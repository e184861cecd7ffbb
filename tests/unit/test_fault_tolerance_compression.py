"""A compressor's state across fault-tolerant steps, without torchft and without processes.

:class:`distopt.fault_tolerance.compressor_state.CompressorState` on the real compressors:
what a discarded step puts back, what a replica that heals keeps and takes. The codecs run
here on a simulated world of one (:mod:`distopt.compression.testing`), which is enough to move
their state; tests/fault_tolerance runs them on real replicas.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from distopt.compression import Compressor, PackLayout, PowerSGD, Quantize, TopK
from distopt.compression.testing import layout_of as _layout
from distopt.compression.testing import simulate
from distopt.fault_tolerance.compressor_state import CompressorState


def _step(compressor, layout: PackLayout, seed: int, step: int, contributing: bool = True) -> None:
    data = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))
    simulate([compressor.codec(layout)], [data], step=step, contributing=[contributing])


def _state(compressor) -> dict:
    return {k: {n: t.clone() for n, t in v.items()} for k, v in compressor.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) for n in a[k])
                                        for k in a)


def test_a_discarded_step_puts_powersgd_residuals_and_q_back() -> None:
    compressor, layout = PowerSGD(rank=2), _layout([(16, 12), (6,)])
    state = CompressorState(compressor)
    _step(compressor, layout, seed=1, step=0)
    before = _state(compressor)
    state.before_round()
    _step(compressor, layout, seed=2, step=1)
    assert not _equal(_state(compressor), before)  # the round moved them
    state.settle(committed=False, healed=False)
    assert _equal(_state(compressor), before) and state.discards_undone == 1


def test_a_committed_step_keeps_what_the_round_made() -> None:
    compressor, layout = Quantize(bits=8, block_size=8), _layout([(5, 7)])
    state = CompressorState(compressor)
    state.before_round()
    _step(compressor, layout, seed=3, step=0)
    after = _state(compressor)
    state.settle(committed=True, healed=False)
    assert _equal(_state(compressor), after) and state.discards_undone == 0


@pytest.mark.parametrize("make", [lambda: Quantize(bits=4, block_size=8), lambda: TopK(group_size=4)],
                         ids=["int4", "topk"])
def test_a_discarded_step_puts_the_residuals_back_and_the_codec_uses_them(make: Callable[[], Compressor]) -> None:
    compressor, layout = make(), _layout([(5, 7)])
    state = CompressorState(compressor)
    _step(compressor, layout, seed=4, step=0)
    before = _state(compressor)
    state.before_round()
    _step(compressor, layout, seed=5, step=1)
    state.settle(committed=False, healed=False)
    # The codec's buffers are rebuilt from the state put back: the next step starts from it.
    replay = make()
    replay.load_state_dict(before)
    _step(compressor, layout, seed=6, step=1)
    _step(replay, layout, seed=6, step=1)
    assert _equal(_state(compressor), _state(replay))


def test_a_healing_replica_takes_no_residual_and_keeps_its_own_q_when_the_step_commits() -> None:
    peer, mine, layout = PowerSGD(rank=2), PowerSGD(rank=2), _layout([(16, 12)])
    _step(peer, layout, seed=7, step=0)
    _step(mine, layout, seed=8, step=0)
    state = CompressorState(mine)
    state.before_round()
    _step(mine, layout, seed=9, step=1, contributing=False)  # a healing replica sends zeros
    own_q = {k: v.clone() for k, v in mine.state_dict()["qs"].items()}
    state.take_peer(peer.state_dict())
    state.settle(committed=True, healed=True)
    assert mine.state_dict()["residuals"] == {}  # a residual is what one replica owes: never copied
    assert all(torch.equal(mine.state_dict()["qs"][k], own_q[k]) for k in own_q)


def test_a_healing_replica_takes_the_peers_q_when_the_step_is_discarded() -> None:
    peer, mine, layout = PowerSGD(rank=2), PowerSGD(rank=2), _layout([(16, 12)])
    _step(peer, layout, seed=10, step=0)
    state = CompressorState(mine)
    state.before_round()
    _step(mine, layout, seed=11, step=1, contributing=False)
    state.take_peer(peer.state_dict())
    state.settle(committed=False, healed=True)
    assert mine.state_dict()["residuals"] == {}
    assert _equal({"qs": mine.state_dict()["qs"]}, {"qs": peer.state_dict()["qs"]})


def test_quantize_keeps_the_members_residuals_when_the_number_of_ranks_changes() -> None:
    compressor, layout = Quantize(bits=8, block_size=8), _layout([(5, 7)])
    codec = compressor.codec(layout)
    data = torch.randn(35, generator=torch.Generator().manual_seed(12))
    # World 1, then world 2 (the padded buffer grows): the member's residual carries over.
    simulate([codec], [data.clone()])
    kept = compressor.residuals[(False, 0)].clone()
    padded = -(-35 // (2 * 8)) * 8 * 2  # the codec's layout for 2 ranks: whole blocks per rank's chunk
    residual = codec.residuals.buffer(False, padded=padded, device=torch.device("cpu"))
    assert residual.numel() == 48 and torch.equal(compressor.residuals[(False, 0)], kept)
    assert compressor.residuals[(False, 0)].data_ptr() == residual.data_ptr()  # a view of the new buffer
