"""Break each promise on purpose, one at a time, and show that the suite notices.

Usage::

    python tests/mutation.py            # every mutant, with its tests
    python tests/mutation.py threshold  # one of them, by name

Each mutant is one textual change to one file of a copy of the repository (the
copied text must occur exactly once, so a mutant cannot silently stop applying).
The copy runs the tests that guard the promise; the mutant is *killed* when at
least one of them fails. The script ends with a table and exits 1 if any mutant
survived. It is not a test module (pytest collects ``test_*.py`` only): it takes a
few minutes and runs before a release or after a change to the suite.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str  # what is broken
    path: str  # the file, relative to the repository
    old: str  # text that occurs exactly once in it
    new: str  # what replaces it
    tests: Sequence[str]  # pytest arguments that select the guarding tests


MUTANTS: List[Mutant] = [
    Mutant("threshold", "distopt/planning/packing.py",
           "if open_bytes[slot] >= threshold:", "if False:",
           ["tests/unit/test_packing.py", "tests/multiprocess/test_optimizer_dist.py", "-k",
            "several_members or pack"]),
    Mutant("re-broadcast period", "distopt/wrapper/optimizer.py",
           "engine.steps % self.bcast_period == 0", "engine.steps == self.bcast_period",
           ["tests/multiprocess/test_optimizer_dist.py", "-k", "bcast"]),
    Mutant("mean/sum", "distopt/engine/opening.py",
           '    mean = reduce_op == "mean"\n',
           '    mean = reduce_op != "mean"\n',
           ["tests/multiprocess/test_optimizer_dist.py", "-k", "matches_single_process or ddp"]),
    Mutant("dtype key", "distopt/engine/packs.py",
           "return [ParamMeta((p.device, p.dtype), p.numel(), p.element_size()) for p in params]",
           "return [ParamMeta((p.device,), p.numel(), p.element_size()) for p in params]",
           ["tests/multiprocess/test_optimizer_dist.py", "-k", "random_parameter_sets or matches_single_process"]),
    Mutant("flush before step", "distopt/modes/synchronous.py",
           "            ctx.reduce_for_step()\n", "",
           ["tests/multiprocess/test_agreement.py", "-k", "skipped_batch"]),
    Mutant("skip of a frozen parameter", "distopt/engine/engine.py",
           "trainable = [(p, n) for p, n in zip(params, names) if p.requires_grad]",
           "trainable = [(p, n) for p, n in zip(params, names)]",
           ["tests/multiprocess/test_agreement.py", "-k", "frozen"]),
    Mutant("join's contributor count", "distopt/planning/control.py",
           "return world_size / self.contributing", "return 1.0",
           ["tests/multiprocess/test_join.py", "-k", "uneven_batches_train_like"]),
    Mutant("sharded step's owner map", "distopt/modes/sharded.py",
           "return self.owner_of.get(id(p), self.rank) == self.rank", "return True",
           ["tests/multiprocess/test_sharded.py", "-k", "trains_exactly_like_the_unsharded"]),
    Mutant("sharded share's wait before a forward", "distopt/modes/parameter_share.py",
           "            self._hook = torch_module.register_module_forward_pre_hook(pre_hook)\n",
           "            pass\n",
           ["tests/multiprocess/test_sharded.py", "-k", "never_read_stale"]),
    Mutant("sharded share running on after step()", "distopt/modes/sharded.py",
           "            self._launch_share(ctx)\n",
           "            self._launch_share(ctx)\n            self._finish_share()\n",
           ["tests/multiprocess/test_sharded.py", "-k", "never_read_stale"]),
    Mutant("sharded share not finished in step() by default", "distopt/modes/sharded.py",
           '            if self.share == "in_step":\n', "            if False:\n",
           ["tests/multiprocess/test_sharded.py", "-k", "weight_ema"]),
    Mutant("sharded gradients: an inf on one rank's slice shown on every rank's", "distopt/modes/sharded.py",
           '                first_owned.view(-1)[0] = float("inf")\n', "                pass\n",
           ["tests/multiprocess/test_sharded.py", "-k", "sharded_gradients"]),
    Mutant("sharded gradients: the packs grouped by owner", "distopt/engine/packs.py",
           "        specs = grouped_by_owner(specs, metas(params), owners)\n", "        pass\n",
           ["tests/multiprocess/test_sharded.py", "-k", "sharded_gradients"]),
    Mutant("sharded gradients: the norm summed over the ranks", "distopt/modes/sharded.py",
           '                    collectives.all_reduce(total, op="sum", group=ctx.engine.channel.group)\n',
           "                    pass\n",
           ["tests/multiprocess/test_sharded.py", "-k", "sharded_gradients"]),
    Mutant("sharded gradients: a large chunk received in parts, into room for one part", "distopt/engine/in_flight.py",
           "    part = max(1, SCATTER_PART_BYTES // element_size, -(-numel // SCATTER_PARTS))\n",
           "    part = numel\n",
           ["tests/multiprocess/test_sharded.py", "-k", "sharded_gradients_train and not 3"]),
    Mutant("sharded gradients: the round a rank joined in hands its gradients to the new owners",
           "distopt/modes/sharded.py",
           "            grads = {index[id(p)]: p.grad.detach().cpu().clone() for p in moving if p.grad is not None}\n",
           "            grads = {}\n",
           ["tests/multiprocess/test_sharded.py", "-k", "gradscaler_skips_after"]),
    Mutant("sharded share's check of parameters changed in flight", "distopt/modes/parameter_share.py",
           "if p._version != version]", "if False]",
           ["tests/multiprocess/test_sharded.py", "-k", "never_read_stale"]),
    Mutant("local SGD's anchor update", "distopt/modes/local_sgd.py",
           "                anchor.sub_(pseudo)\n", "                anchor.sub_(pseudo * 0.5)\n",
           ["tests/multiprocess/test_local_sgd.py", "-k", "matches_the_single_process_simulation"]),
    Mutant("quantiser's error feedback", "distopt/compression/quantize.py",
           "residual if round.contributing else None,\n", "None,\n",
           ["tests/unit/test_compressors.py", "-k", "feedback"]),
    Mutant("PowerSGD's residual share", "distopt/compression/powersgd.py",
           "m_.addmm_(p, qt, alpha=-1.0 / contributors)", "m_.addmm_(p, qt, alpha=-1.0)",
           ["tests/unit/test_compressors.py", "-k", "powersgd"]),
    Mutant("PowerSGD's share over the contributors in a join", "distopt/compression/powersgd.py",
           "m_.addmm_(p, qt, alpha=-1.0 / contributors)", "m_.addmm_(p, qt, alpha=-1.0 / round.world_size)",
           ["tests/unit/test_compressors.py", "-k", "applied_once and powersgd"]),
    Mutant("sign's residual across a join", "distopt/compression/sign.py",
           "            settle_residual(residual, data, round, lambda: sent)\n", "            pass\n",
           ["tests/unit/test_compressors.py", "-k", "applied_once and sign"]),
    Mutant("the codec simulator's expected factor", "distopt/compression/testing.py",
           "factor = 1.0 if all(live) or self._last is None else factor_of(self._last)", "factor = 1.0",
           ["tests/unit/test_compressors.py", "-k", "codec_world"]),
    Mutant("a list of compressor names of its own", "examples/train_digits.py",
           'choices=("none", *distopt.compression.NAMES)', 'choices=("none", "fp16", "bf16", "int8")',
           ["tests/unit/test_compressors.py", "-k", "list_of_compressor_names"]),
    Mutant("codecs told the factor of the round a rank joins in", "distopt/engine/engine.py",
           "outcome.contributors, outcome.factor = totals.contributing, totals.rescale(self.world_size, self.config.mean)",
           "outcome.contributors, outcome.factor = totals.contributing, self.expected_factor()",
           ["tests/multiprocess/test_compression.py", "-k", "trains_like_single_process and (topk or int8)"]),
    Mutant("one Round.step on every rank through a join", "distopt/engine/engine.py",
           "step=self._round_step if self.round_hooks is None else self.round_hooks.quorum_step",
           "step=self.steps if self.round_hooks is None else self.round_hooks.quorum_step",
           ["tests/multiprocess/test_compression.py", "-k", "same_round_step"]),
    Mutant("one order of codec collectives on every rank", "distopt/engine/engine.py",
           "        for sent in codecs:\n            if sent.carrier is not None:",
           "        for sent in (codecs if self.channel.group.rank() == 0 else codecs[::-1]):\n"
           "            if sent.carrier is not None:",
           ["tests/multiprocess/test_compression.py", "-k", "pair_up"]),
    Mutant("compressor state in checkpoints", "distopt/wrapper/optimizer.py",
           "            self.compressor.load_state_dict(compressed)\n", "            pass\n",
           ["tests/multiprocess/test_compression.py", "-k", "resumes_bitwise"]),
    Mutant("compressor state in sharded checkpoints", "distopt/wrapper/optimizer.py",
           "            shard[COMPRESSION_KEY] = self.compressor.state_dict()\n", "            pass\n",
           ["tests/multiprocess/test_compression.py", "-k", "sharded_checkpoint"]),
    Mutant("compressor state of merged shards", "distopt/modes/shards.py",
           'if kept.get("world_size") == world_size and 0 <= rank < len(ranks):',
           'if False:',
           ["tests/multiprocess/test_compression.py", "-k", "sharded_checkpoint"]),
    Mutant("fault tolerance: a heal across a streaming sync's overlap", "distopt/modes/streaming.py",
           "                ctx.set_steps(ctx.steps + since)\n", "                pass\n",
           ["tests/fault_tolerance/test_fault_tolerance.py", "-k", "streaming"]),
    Mutant("fault tolerance: the quorum names the streaming fragment", "distopt/modes/streaming.py",
           "        fragment = vote.quorum_step % schedule.fragments\n",
           "        fragment = (schedule.launches(step) or [0])[0]\n",
           ["tests/fault_tolerance/test_fault_tolerance.py", "-k", "streaming"]),
    Mutant("fault tolerance: a streaming sync voted down goes back to its anchors", "distopt/modes/streaming.py",
           "                        p.copy_(self._anchor_of(p))\n", "                        pass\n",
           ["tests/fault_tolerance/test_fault_tolerance.py", "-k", "streaming"]),
    Mutant("fault tolerance: settings compared before the first collective", "distopt/fault_tolerance/controller.py",
           "            self._check_settings()\n", "",
           ["tests/unit/test_fault_tolerance_arguments.py", "tests/fault_tolerance/test_fault_tolerance_settings.py"]),
    Mutant("launch: each worker seeds its random generators anew", "distopt/launching/worker.py",
           "    _reseed()\n", "",
           ["tests/launching/test_launcher.py", "-k", "random_numbers"]),
    Mutant("launch: the fork server follows the launch's environment", "distopt/launching/fork_server.py",
           'if ours and environ == _started.get("environ"):', "if ours:",
           ["tests/launching/test_launcher.py", "-k", "environment_at_the_launch"]),
    Mutant("launch: a failed worker's children end with it", "distopt/launching/supervisor.py",
           "failed = [proc.pid for proc in started if proc not in alive and proc.exitcode != 0]", "failed = []",
           ["tests/launching/test_launcher.py", "-k", "own_child"]),
    Mutant("shutdown during an error is no finish", "distopt/launching/lifecycle.py",
           "    stalls.mark_exit(stalls.ending())\n", '    stalls.mark_exit("finished")\n',
           ["tests/launching/test_launcher.py", "-k", "shuts_down_while"]),
    Mutant("gone-rank verdict: a failed call's exit read as finished", "distopt/transport/stalls.py",
           'progress.state = "exited" if state == "finished" and progress.failed else state',
           "progress.state = state",
           ["tests/unit/test_inspector_errors.py", "-k", "exit"]),
    Mutant("gone-rank verdict: a survivor that failed too named as the cause", "distopt/transport/stalls.py",
           'gone.sort(key=lambda item: (bool(item[1].get("lost")), item[1]["how"]',
           'gone.sort(key=lambda item: (False, item[1]["how"]',
           ["tests/unit/test_inspector_errors.py", "-k", "killed"]),
    Mutant("gone-rank verdict: an exiting peer read as alive", "distopt/transport/stalls.py",
           ' or bool(int(fields[6]) & _PF_EXITING)', "",
           ["tests/unit/test_inspector_errors.py", "-k", "exiting"]),
    Mutant("join: a rank's last exchange says it leaves, before a drift check", "distopt/planning/control.py",
           "        return self.contributing - self.leaving\n", "        return self.contributing\n",
           ["tests/multiprocess/test_local_sgd.py", "tests/multiprocess/test_streaming.py", "-k",
            "drift_check_due_after_a_rank or check_drift_inside_join"]),
    Mutant("join: check_drift() inside a block sends a probe round first", "distopt/wrapper/optimizer.py",
           "        if engine.join.in_block and self._compared_size() > 1:\n            self._probe_before_check()\n",
           "",
           ["tests/multiprocess/test_join.py", "-k", "check_drift_at_the_top"]),
    Mutant("join: a probe round has buffers of its own (the gradients stay)", "distopt/engine/engine.py",
           "self.packs = [probe_copy(pack) for pack in self.packs]", "self.packs = list(self.packs)",
           ["tests/multiprocess/test_join.py", "-k", "changes_no_parameter"]),
    Mutant("join: a probe round leaves the compressor's state as it was", "distopt/engine/engine.py",
           "                    compressor.load_state_dict(before)\n", "                    pass\n",
           ["tests/multiprocess/test_join.py", "-k", "changes_no_parameter"]),
    Mutant("join: a joined rank does nothing for a probe round but shadow it", "distopt/engine/engine.py",
           "                                    probe=True).tensor()", "                                    probe=False).tensor()",
           ["tests/multiprocess/test_sharded.py", "-k", "check_drift_at_the_top"]),
    Mutant("streaming: a drift check waits for the exchange of its step", "distopt/modes/streaming.py",
           "        ctx.engine.arrive_partial(exchange)\n        return ctx.engine.outcome.training if",
           "        return ctx.engine.outcome.training\n        return ctx.engine.outcome.training if",
           ["tests/multiprocess/test_streaming.py", "-k", "drift_check_due_after_a_rank or check_drift_inside_join"]),
    Mutant("DiLoCo: no rank sent a frozen parameter, so the outer optimizer skips it", "distopt/modes/local_sgd.py",
           "                if not present[j]:\n", "                if present[j] < 0:\n",
           ["tests/multiprocess/test_local_sgd.py", "tests/multiprocess/test_streaming.py", "-k", "frozen"]),
    Mutant("modes: a mode object serves one wrapper", "distopt/modes/base.py",
           "        if current is not None and current is not owner:\n", "        if False:\n",
           ["tests/unit/test_modes.py", "-k", "serves_one_wrapper"]),
    Mutant("agreement: a setting only another rank's mode has is compared", "distopt/wrapper/checks.py",
           "    for key in sorted(keys, key=lambda k: k == \"mode\"):", "    for key in settings:",
           ["tests/unit/test_modes.py", "-k", "told_the_setting"]),
    Mutant("islands: rank j of each island sums slice j across", "distopt/modes/island_slices.py",
           "start, stop = place * self.length, (place + 1) * self.length",
           "start, stop = 0, self.length",
           ["tests/multiprocess/test_islands.py", "-k", "global_batch"]),
    Mutant("islands: a gradient no island had stays None", "distopt/modes/islands.py",
           "present = None if complete else self._presence(ctx, group)", "present = None",
           ["tests/multiprocess/test_islands.py", "-k", "global_batch"]),
    Mutant("islands: every island starts from island 0's parameters", "distopt/modes/islands.py",
           "if self._bcast_period != -1 and engine.world_size > 1 and ctx.params:",
           "if False:",
           ["tests/multiprocess/test_islands.py", "-k", "island_0s_parameters"]),
    Mutant("islands: the across mode steps through the across engine", "distopt/modes/islands.py",
           "                loss = self.across.step(across, None)\n",
           "                loss = self.across.step(ctx, None)\n",
           ["tests/multiprocess/test_islands.py", "-k", "replay or flat_streaming"]),
    Mutant("islands, inside=ShardedState(): each rank steps its shard only", "distopt/modes/islands.py",
           "            if self.inside is not None and self._sums_gradients:\n",
           "            if False:\n",
           ["tests/multiprocess/test_islands.py", "-k", "sharded_state_inside_each_island"]),
    Mutant("islands, inside=ShardedState(), local SGD across: the inner step is the inside mode's",
           "distopt/modes/islands.py",
           "inner_step=None if self.inside is None else _stepping_inside(self, ctx))",
           "inner_step=None)",
           ["tests/multiprocess/test_islands.py", "-k", "sharded_state_inside_each_island"]),
    Mutant("islands, inside=ShardedState(), local SGD across: the share arrives before a sync reads it",
           "distopt/modes/islands.py",
           "        if self.inside is not None:\n            self.inside.finish_step(self._inside(ctx))\n"
           "        island = ctx.engine\n",
           "        island = ctx.engine\n",
           ["tests/multiprocess/test_islands.py", "-k", "sharded_state_inside_each_island"]),
    Mutant("islands: inside join(), each island's mean counts by its contributors", "distopt/modes/islands.py",
           "        return mine / self._contributors\n", "        return engine.scale\n",
           ["tests/multiprocess/test_islands.py", "-k", "uneven_batches"]),
    Mutant("islands, local SGD across in join(): a rank out of data takes its island's parameters",
           "distopt/modes/islands.py",
           "            collectives.broadcast_parameters(ctx.params, src=int(source.item()), group=group)\n",
           "            pass\n",
           ["tests/multiprocess/test_islands.py", "-k", "join_with_diloco_across or join_with_streaming"]),
    Mutant("islands, local SGD across in join(): a sync averages over the islands still training",
           "distopt/modes/islands.py",
           "self._across_join = self._engine.enter_join(island.join.divide_by_world)",
           "self._across_join = self._engine.enter_join(True)",
           ["tests/multiprocess/test_islands.py", "-k", "join_with_diloco_across or join_with_streaming"]),
    Mutant("islands: the drift check and the broadcasts reach every island", "distopt/modes/islands.py",
           "        if self._world is not None:\n            whole = self._world\n",
           "        if False:\n            whole = self._world\n",
           ["tests/multiprocess/test_islands.py", "-k", "drift or broadcast"]),
    Mutant("join(): an optimizer that joins alone is refused in a block with others", "distopt/wrapper/join.py",
           "if len(parties) > 1 and party.mode.joins_alone(party.context)", "if False",
           ["tests/multiprocess/test_islands.py", "-k", "joined_in_one_block"]),
    Mutant("islands over FSDP2: each local shard's gradient is averaged across the islands", "distopt/modes/islands.py",
           "                        grads[i].copy_(view)\n", "                        pass\n",
           ["tests/multiprocess/test_islands.py", "-k", "fsdp2_inside_and_synchronous"]),
    Mutant("islands over FSDP2: every rank of an island acts on a drift found in any shard",
           "distopt/modes/islands.py",
           "        return next((r for r in reports if r.drifted), report)\n", "        return report\n",
           ["tests/multiprocess/test_islands.py", "-k", "fsdp2_inside_the_drift_check"]),
    Mutant("islands under fault tolerance: every island takes its root's state after the job's first step",
           "distopt/modes/islands.py",
           "        if self._vote.quorum_step != 0 or ctx.world_size == 1:\n            return\n", "        return\n",
           ["tests/fault_tolerance/test_launch.py", "-k", "island"]),
    # These two are killed as root only (the test builds network namespaces; elsewhere it skips).
    Mutant("link benchmark: a host's ranks share its namespace", "distopt/benchmark/slow_link/supervisor.py",
           "        return self.link.hosts[rank // self.ranks_per_host]\n",
           "        return self.link.hosts[rank % len(self.link.hosts)]\n",
           ["tests/fronts/test_benchmark_islands.py", "-k", "shaped_link"]),
    Mutant("link benchmark: a namespace's veth bytes are its ranks' together", "distopt/benchmark/slow_link/child.py",
           "        share = (interface_tx_bytes() - first) // (job.options.ranks_per_host * n)\n",
           "        share = (interface_tx_bytes() - first) // n\n",
           ["tests/fronts/test_benchmark_islands.py", "-k", "shaped_link"]),
    Mutant("small sums: a direct pack's gradient and flags share the room for their copies",
           "distopt/engine/in_flight.py", "    key = (flags, tensor.numel(), tensor.dtype)\n",
           "    key = (False, tensor.numel(), tensor.dtype)\n",
           ["tests/multiprocess/test_small_sums.py", "tests/multiprocess/test_pack_paths.py", "-k", "room or complex"]),
    Mutant("probe round: the reduce-scatter sends the real pack's chunks", "distopt/engine/packs.py",
           "                   chunks=chunks, scattered=None)\n", "                   scattered=None)\n",
           ["tests/multiprocess/test_sharded.py", "-k", "check_drift_at_the_top"]),
    Mutant("stall inspector: a finalizer's retire() waits for the lock", "distopt/transport/stalls.py",
           "    _inspector.leaving.append(progress)\n",
           "    with _inspector.lock:\n        _inspector.progresses.discard(progress)\n",
           ["tests/unit/test_inspector_thread.py"]),
]


def _copy(to: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in files:
        source = ROOT / name
        if source.is_file():
            target = to / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def run(mutant: Mutant) -> Tuple[bool, float, str]:
    """Apply ``mutant`` to a fresh copy and run its tests: ``(killed, seconds, last line of pytest)``."""
    with tempfile.TemporaryDirectory(prefix="distopt-mutant-") as tmp:
        copy = Path(tmp)
        _copy(copy)
        target = copy / mutant.path
        text = target.read_text()
        if text.count(mutant.old) != 1:
            raise SystemExit(f"mutant {mutant.name!r}: its text occurs {text.count(mutant.old)} times in "
                             f"{mutant.path}, not once; update the mutant to the code")
        target.write_text(text.replace(mutant.old, mutant.new))
        start = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": str(copy)}  # the copy's distopt, not the installed checkout
        proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=1200)
        failed = [line.split(" - ")[0][len("FAILED "):] for line in proc.stdout.splitlines()
                  if line.startswith("FAILED ")]
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        said = failed[0] if failed else (lines[-1] if lines else proc.stderr[-200:])
        return proc.returncode != 0, time.perf_counter() - start, said


def main(argv: Sequence[str]) -> int:
    chosen = [m for m in MUTANTS if not argv or m.name in argv or m.name.split()[0] in argv]
    rows = []
    for mutant in chosen:
        killed, seconds, last = run(mutant)
        rows.append((mutant.name, "killed" if killed else "SURVIVED", f"{seconds:.0f} s", last))
        print(f"{mutant.name:28} {rows[-1][1]:9} {rows[-1][2]:>6}  {last}", flush=True)
    print("\n| mutant | result | time | the test that failed |\n|---|---|---|---|")
    for name, result, seconds, last in rows:
        print(f"| {name} | {result} | {seconds} | {last} |")
    return 0 if all(result == "killed" for _, result, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
