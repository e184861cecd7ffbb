"""A model still wrapped in DistributedDataParallel under a DistributedOptimizer: refused at its first forward.

DDP averages the gradients of the parameters it wraps in its own autograd hooks, which
torch keeps in C++: nothing on the parameters or in the graph shows them. The one place
torch shows DDP is its forward, a module call like any other, which global module
hooks (``torch.nn.modules.module.register_module_forward_pre_hook``) see. So from its
construction until its first ``step()``, a reducing wrapper has one such hook watch the
forward passes; a DDP module whose parameters a wrapper reduces raises there.

It is an error rather than a warning because the result is never right. The wrapper's
hook runs first: it moves each gradient into its pack, scaled by ``1/world``, and leaves
``.grad`` a view of it; DDP then copies that scaled gradient into its bucket, averages
it and, at the end of backward, writes its result over the wrapper's. With DDP's
defaults every gradient comes out divided by the world size once more (half the
gradient on two ranks, as measured), and with ``gradient_as_bucket_view=True`` DDP fails
with an error about its bucket views. DDP writes last whatever its process group, so
over another group the wrapper's average is lost too.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from . import checks

__all__ = ["watch", "unwatch"]

# Wrappers that have not stepped yet; the hook is installed while there is one.
_watching: "weakref.WeakSet[Any]" = weakref.WeakSet()
_handle: Optional[RemovableHandle] = None


def watch(wrapper: Any) -> None:
    """Refuse a DDP module over ``wrapper``'s parameters at its forward, until :func:`unwatch`."""
    global _handle
    _watching.add(wrapper)
    if _handle is None:
        _handle = nn.modules.module.register_module_forward_pre_hook(_check)


def unwatch(wrapper: Any) -> None:
    """Stop watching for ``wrapper`` (it stepped, or was closed); the hook goes with the last one."""
    _watching.discard(wrapper)
    _release_if_idle()


def _release_if_idle() -> None:
    global _handle
    if not _watching and _handle is not None:
        # Every module call takes torch's slow path while a global hook is installed.
        _handle.remove()
        _handle = None


def _check(module: nn.Module, args: Any) -> None:
    if not isinstance(module, DistributedDataParallel):
        _release_if_idle()  # wrappers collected without a step() or close()
        return
    ignored = getattr(module, "parameters_to_ignore", ())
    reduced: List[str] = []
    for name, p in module.module.named_parameters():
        wrapper = checks.owner(p)
        if p.requires_grad and name not in ignored and wrapper is not None and wrapper.world_size > 1:
            reduced.append(name)
    if not reduced:
        return
    shown = ", ".join(repr(n) for n in reduced[:3]) + (f" and {len(reduced) - 3} more" if len(reduced) > 3 else "")
    raise RuntimeError(
        f"this model is wrapped in DistributedDataParallel, and a DistributedOptimizer averages the gradients of "
        f"the same parameters ({shown}): each gradient would be averaged twice, and DDP's result, written last, "
        "is divided by the world size once more (with gradient_as_bucket_view=True DDP fails instead). Remove the "
        "DDP wrapper and call the model itself (e.g. `model = ddp_model.module`): the DistributedOptimizer already "
        "averages the gradients, and broadcasts the initial parameters when it is built. To keep DDP for part of a "
        "model, leave that part's parameters out of the DistributedOptimizer"
    )
