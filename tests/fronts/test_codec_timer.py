"""bench/codecs.py, the codecs' timer: it runs every built-in compressor and answers each collective."""
import importlib.util
from pathlib import Path

import pytest
import torch

from distopt.compression import NAMES
from distopt.compression.testing import CodecWorld

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "codecs.py"


@pytest.fixture(scope="module")
def codecs():
    spec = importlib.util.spec_from_file_location("bench_codecs", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("world", [2, 3])
def test_every_compressor_is_timed_through_each_of_its_stages(codecs, world):
    # Every name but the casts, which the engine does inline (they have no codec to time).
    assert set(codecs.COMPRESSORS) == set(NAMES) - {"fp16", "bf16"}
    for name, make in codecs.COMPRESSORS.items():
        phases = codecs.time_codec(make, 4096, world, 2, torch.device("cpu"))
        assert set(phases) == {"encode", "between", "decode"} and all(v >= 0 for v in phases.values()), name
        # Stages between the first collective and the last (PowerSGD's Q, the quantisers' second beyond two ranks).
        ranks = CodecWorld(make, codecs.layout_of([(64, 64)]), world)
        staged = len(ranks.round([torch.randn(4096) for _ in range(world)])) > 1
        assert (phases["between"] > 0) == staged, (name, phases)
