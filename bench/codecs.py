"""What each built-in compressor's arithmetic costs one rank, per pack, on a CPU core or a GPU.

    python bench/codecs.py [--device cuda] [--numel 786432] [--world 2] [--repeats 30]

No processes and no network: one rank's codec runs on a pack of ``--numel`` float32 values
(default: a 3 MiB fragment, the slow-link benchmark's mlp at ``sync_fragments=4``), and each
collective it yields is answered in place as if every rank had sent what this one did
(:func:`distopt.compression.testing.mirror`). Every compressor of
:data:`distopt.compression.NAMES` that works through codecs is timed (a cast has none). So
the figures are the codec's own work: what it does before its first collective (encode:
error feedback, selection or quantisation) and after its last (decode: the sum), not the
time on the wire, which ``python -m distopt.benchmark --link`` measures. Medians of
``--repeats`` rounds after three warm-up rounds, in milliseconds; on CUDA each phase is
synchronised before its clock stops.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, Iterator, List

import torch

from distopt.compression import NAMES, Collective, Compressor, Round
from distopt.compression.testing import layout_of, mirror

#: The compressors timed, by the name ``compression=`` takes: those that work through codecs.
COMPRESSORS: Dict[str, Callable[[], Compressor]] = {
    name: entry for name, entry in NAMES.items() if entry().wire_dtype(torch.float32) is None
}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_codec(make: Callable[[], Compressor], numel: int, world: int, repeats: int,
               device: torch.device) -> Dict[str, float]:
    """Median milliseconds of encode, decode, and the stages between (PowerSGD's), per round."""
    side = int(numel ** 0.5)
    shape = torch.Size((side, numel // side))  # one matrix member, so PowerSGD has something to factor
    layout = layout_of([shape], device=device)
    codec = make().codec(layout)
    gen = torch.Generator(device=device).manual_seed(0)
    phases: Dict[str, List[float]] = {"encode": [], "between": [], "decode": []}
    for step in range(repeats + 3):
        data = torch.randn(layout.numel, generator=gen, device=device)
        start = _clock(device)
        round = Round(rank=0, world_size=world, step=step)
        rounds: Iterator[Collective] = codec.reduce(data, round)
        collective = next(rounds)
        marks = [_clock(device)]
        while True:
            mirror(collective, world)
            round.outcome.contributors, round.outcome.factor = world, 1.0  # what the engine fills in
            marks.append(_clock(device))
            following = next(rounds, None)
            marks.append(_clock(device))
            if following is None:
                break
            collective = following
        if step >= 3:
            phases["encode"].append(marks[0] - start)
            phases["decode"].append(marks[-1] - marks[-2])
            phases["between"].append(sum(b - a for a, b in zip(marks[1:-2:2], marks[2:-2:2])))
    return {phase: 1e3 * statistics.median(values) for phase, values in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--numel", type=int, default=3 << 18, help="values in the pack (default: 786432, 3 MiB)")
    parser.add_argument("--world", type=int, default=2, help="ranks the codecs plan for (default: 2)")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds (default: 30)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (default: 1, as one rank a core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"{args.numel} float32 values ({args.numel * 4 / 2**20:.1f} MiB) a pack, {args.world} ranks, on {name}; "
          f"median ms of {args.repeats} rounds")
    print(f"{'compressor':<10} {'encode':>8} {'between':>8} {'decode':>8} {'total':>8}")
    for label, make in COMPRESSORS.items():
        t = time_codec(make, args.numel, args.world, args.repeats, device)
        print(f"{label:<10} {t['encode']:8.3f} {t['between']:8.3f} {t['decode']:8.3f} {sum(t.values()):8.3f}")


if __name__ == "__main__":
    main()
