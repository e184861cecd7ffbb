"""The slow-link benchmark: ``python -m distopt.benchmark --link 200mbit``.

It builds two network namespaces joined by a veth pair whose ends are both shaped
with ``tc qdisc ... tbf`` to the stated rate, runs one rank in each (pinned to its
own core, gloo over the veth addresses), checks what the link carries with a TCP
transfer, and then, task by task, runs every contender side by side: local training
without communication, DDP plain and with its comm hooks (fp16, PowerSGD,
PostLocalSGD), and distopt with each compressor alone and with local SGD, and
DiLoCo. With ``--ranks-per-host K`` each namespace holds ``K`` ranks (loopback between
them, the shaped link between the namespaces) and the contenders are the two-level
ones: each island alone, HSDP, and ``distopt.Islands`` with each mode across, beside
flat DDP and distopt. Each contender has a process per rank of its own, forked from
one long-lived host process per rank, so one that aborts (DDP's PowerSGD hook does, on
gloo over a shaped link) is reported with its reason while the others go on; the
contenders still take turns in interleaved rounds, so that machine noise hits all
alike. Everything it built is removed afterwards, also on an error or Ctrl-C.

It reports ms per step and bytes per step on two models with 12 MiB of gradients,
and on a real task (a character-level transformer on the standard library's own
sources) the steps and seconds to a target loss and the loss at a fixed step count;
``--plots`` draws loss against time and bytes per step. Root is needed; without it
the command says so and what to do.

Modules, each depending only on those listed before it:

* :mod:`.rates`: ``200mbit`` to bits per second and back.
* :mod:`.shaping`: the tbf settings for a rate (:func:`choose_tbf`), and why.
* :mod:`.namespaces`: :class:`ShapedLink`, the namespaces and the veth pair; the root check.
* :mod:`.text`: :class:`StdlibText`, the real task's data.
* :mod:`.charlm`: :class:`CharTransformer`, the real task's model.
* :mod:`.tasks`: :data:`TASKS`, what the contenders train, and their schedules.
* :mod:`.contenders`: :data:`CONTENDERS`, and :data:`DISTOPT_SPECS`, the table of distopt's.
* :mod:`.probe`: the TCP check of the link's rate.
* :mod:`.child`: one contender on one rank, in its own process.
* :mod:`.host`: a rank's long-lived process, which forks the contenders' processes.
* :mod:`.supervisor`: starts and ends the hosts; one request at a time to a contender.
* :mod:`.results`: the figures, merged over ranks; the target loss.
* :mod:`.config`: :class:`LinkConfig`.
* :mod:`.runner`: :func:`run_link_benchmark`.
* :mod:`.report`: the tables and the JSON; :mod:`.plot`: the PNGs.
* :mod:`.cli`: the ``--link`` flags of ``python -m distopt.benchmark``.
"""
from .config import LinkConfig
from .contenders import CONTENDERS, DISTOPT_SPECS, ContenderOptions, DistoptSpec
from .namespaces import LinkUnavailableError, ShapedLink, check_can_build
from .rates import format_rate, parse_rate
from .report import format_link_report, link_report_to_json
from .results import ContenderRun, Target, TaskResult, choose_target
from .runner import run_link_benchmark
from .shaping import TbfParams, choose_tbf
from .tasks import TASKS
from .text import StdlibText

__all__ = [
    "LinkConfig",
    "CONTENDERS",
    "DISTOPT_SPECS",
    "ContenderOptions",
    "DistoptSpec",
    "LinkUnavailableError",
    "ShapedLink",
    "check_can_build",
    "parse_rate",
    "format_rate",
    "format_link_report",
    "link_report_to_json",
    "ContenderRun",
    "Target",
    "TaskResult",
    "choose_target",
    "run_link_benchmark",
    "TbfParams",
    "choose_tbf",
    "TASKS",
    "StdlibText",
]
