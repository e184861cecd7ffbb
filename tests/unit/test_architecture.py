"""The package's structure is a specification too: layers, no cycles, no reading of others' privates.

The layers themselves are the import-linter contract in ``setup.cfg``; these tests
hold the package to it, and to the two rules a layers contract cannot see: no
import cycle anywhere (``TYPE_CHECKING`` and function-local imports count), and no
module reading another module's private names beyond the few listed below, each
with its reason.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import grimp
import pytest
from importlinter import cli

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "distopt"

#: Private names of torch, the standard library and namedtuples that distopt reads on purpose.
FOREIGN_INTERNALS = {
    "_version": "torch: a tensor's version counter tells whether a gradient changed in place",
    "_values": "torch: a sparse gradient's values, unscaled as GradScaler does",
    "_optimizer_step_pre_hooks": "torch: step hooks run around a sharded step, as torch runs them",
    "_optimizer_step_post_hooks": "torch: step hooks run around a sharded step, as torch runs them",
    "_global_optimizer_pre_hooks": "torch: step hooks run around a sharded step, as torch runs them",
    "_global_optimizer_post_hooks": "torch: step hooks run around a sharded step, as torch runs them",
    "_optimizer_step_code": "torch: the profiler's marker of an optimizer step",
    "_get_backend": "torch: a group's timeout is only reachable through its backend",
    "_device_types": "torch: a group's timeout is only reachable through its backend",
    "_timeout": "torch: a group's timeout is only reachable through its backend",
    "_execution_engine": "torch: the autograd callback at the end of backward (as DDP's reducer uses it)",
    "_get_default_group": "torch: the default group, without creating one",
    "_get_default_store": "torch: the default store, for the stall inspector's positions",
    "_foreach_copy_": "torch: one fused copy of many small gradients into their pack",
    "_amp_foreach_non_finite_check_and_unscale_": "torch: GradScaler's own unscale kernel",
    "_C": "torch: whether the profiler is on",
    "_autograd": "torch: whether the profiler is on",
    "_profiler_enabled": "torch: whether the profiler is on",
    "_exit": "os._exit: a worker whose parent died ends at once",
    "_replace": "namedtuple API",
}

#: Reads of another distopt module's private names that remain, each with its reason.
ALLOWED_PRIVATE_READS: Dict[Tuple[str, str], str] = {
    ("benchmark/mode_specs.py", "opt._engine"):
        "the benchmark's A/B variants switch one engine internal off (the join flag, the stall inspector, "
        "gathered small sums) to measure what it costs",
    ("launching/fork_server.py", "server._stop"):
        "CPython's forkserver has no public way to stop its server, and a launch under another environment "
        "must restart it (a server that preloaded torch keeps the environment it started under)",
    ("horovod/optimizer.py", "opt._retired_by"):
        "the Horovod front's optimizer is a DistributedOptimizer subclass; hvd.join() skips retired ones",
    ("fault_tolerance/manager.py", "transport._server"):
        "torchft 0.2.0's checkpoint server binds every interface, with no argument to choose one: distopt moves "
        "it to the advertised interface (the trust boundary, docs/fault-tolerance.md)",
    ("fault_tolerance/manager.py", "transport._thread"): "likewise: the thread that serves it",
    ("fault_tolerance/manager.py", "transport._serve"): "likewise: what that thread runs",
}
MAX_PRIVATE_READS = 20


def _modules() -> List[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_import_layers_contract_holds() -> None:
    assert cli.lint_imports(config_filename=str(ROOT / "setup.cfg"), no_cache=True, no_logo=True) == 0


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_module_takes_part_in_an_import_cycle() -> None:
    graph = grimp.build_graph("distopt", include_external_packages=False)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_reads(path: Path) -> List[str]:
    """Private names of other objects that ``path`` reads, other than torch's and its own."""
    source = path.read_text()
    tree = ast.parse(source)
    own = set(re.findall(r"def (_\w+)", source)) | set(re.findall(r"self\.(_\w+)\s*[:=]", source))
    own |= set(re.findall(r"^(_\w+)\s*[:=]", source, re.M)) | set(re.findall(r"^class (_\w+)", source, re.M))
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__"):
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            if node.attr in FOREIGN_INTERNALS or node.attr in own:
                continue
            reads.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            reads += [f"import {alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return reads


def test_no_module_reads_another_modules_private_names_beyond_the_listed_ones() -> None:
    found = {(str(path.relative_to(PACKAGE)), read) for path in _modules() for read in _private_reads(path)}
    unexpected = sorted(found - set(ALLOWED_PRIVATE_READS))
    assert unexpected == [], "ask the object through a public method instead, or list it here with its reason"
    stale = sorted(set(ALLOWED_PRIVATE_READS) - found)
    assert stale == [], "remove these from ALLOWED_PRIVATE_READS: they are gone"
    count = sum(len(_private_reads(path)) for path in _modules())
    assert count <= MAX_PRIVATE_READS


#: The module whose class owns the engine's attributes; no other module assigns them.
ENGINE_MODULE = "engine/engine.py"
#: Assignments of an engine's attribute outside it that remain, each with its reason: none.
ALLOWED_ENGINE_ASSIGNMENTS: Dict[Tuple[str, str], str] = {}


def _is_engine(node: ast.AST) -> bool:
    """``engine``, ``_engine``, ``self._engine``, ``ctx.engine``, ``opt._engine``, ..."""
    return ((isinstance(node, ast.Name) and node.id in ("engine", "_engine"))
            or (isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine")))


def _engine_assignments(source: str) -> List[str]:
    """The engine attributes that ``source`` assigns (``engine.x =``, ``a.engine.x, y = ``, ``+=``, ``setattr``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args and _is_engine(node.args[0])):
            found.append(ast.unparse(node))
            continue
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif isinstance(target, ast.Attribute) and _is_engine(target.value):
                found.append(ast.unparse(target))
    return sorted(found)


def test_the_engine_assignment_finder_finds_every_form() -> None:
    source = ("engine.a = 1\nself._engine.b, ctx.engine.c = 2, 3\nopt._engine.d += 1\nsetattr(engine, 'e', 1)\n"
              "engine.progress.phase = 'x'\nengine.f(1)\nother.g = 1\n")
    assert _engine_assignments(source) == ["ctx.engine.c", "engine.a", "opt._engine.d", "self._engine.b",
                                           "setattr(engine, 'e', 1)"]


def test_no_module_but_the_engines_own_assigns_an_engine_attribute() -> None:
    # The engine takes its state at construction and changes it through methods named for what they
    # mean (enter_join, set_world, reconfigure, ...): its state has one owner.
    found = {(str(path.relative_to(PACKAGE)), assigned) for path in _modules()
             if str(path.relative_to(PACKAGE)) != ENGINE_MODULE for assigned in _engine_assignments(path.read_text())}
    assert sorted(found - set(ALLOWED_ENGINE_ASSIGNMENTS)) == [], "call a method of the engine named for what it means"
    assert ALLOWED_ENGINE_ASSIGNMENTS == {}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_declares_its_exports(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert any(isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" in ast.unparse(node).split("=")[0]
               for node in tree.body), f"{path.name} has no __all__"


# One concept per name: a module name used twice names the same role in two fronts (the benchmark's
# and the slow-link benchmark's command line, report, ...), never two concepts of the core.
SHARED_MODULE_NAMES = {
    "cli.py": "the command line of the benchmark and of its slow-link part",
    "config.py": "the settings of the benchmark and of its slow-link part",
    "plot.py": "the plots of the benchmark and of its slow-link part",
    "report.py": "the tables of the benchmark and of its slow-link part",
    "results.py": "the results of the benchmark and of its slow-link part",
    "runner.py": "what runs the benchmark and its slow-link part",
    "supervisor.py": "what watches the launcher's workers, and the slow-link benchmark's hosts",
    "errors.py": "the errors of the launcher and of the Horovod front",
    "optimizer.py": "the DistributedOptimizer, and the Horovod front's over it",
}


def test_no_two_modules_share_a_name_for_different_concepts() -> None:
    names: Dict[str, List[str]] = {}
    for path in _modules():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    shared = {name for name, paths in names.items() if len(paths) > 1}
    assert shared - set(SHARED_MODULE_NAMES) == set(), {name: names[name] for name in shared - set(SHARED_MODULE_NAMES)}
    assert set(SHARED_MODULE_NAMES) - shared == set(), "remove these from SHARED_MODULE_NAMES: no longer shared"
