"""What ``opt.check_drift()`` does inside a join block: shared by the join, local SGD, sharded and streaming tests."""
import time
from typing import Any, Callable, Dict, Optional

__all__ = ["drift_outcome", "checks_at_the_top"]


def drift_outcome(opt: Any) -> str:
    """``opt.check_drift()`` now: "ran", or the RuntimeError it raised at once, "between" (no round of this
    step says who trains on: between two syncs, or after a step that sent no fragment) or "joined" (a
    round's flags said that a rank ran out of data). Any other error propagates."""
    try:
        opt.check_drift()
        return "ran"
    except RuntimeError as exc:
        if "between two syncs" in str(exc):
            return "between"
        if "after a rank ran out of data" in str(exc):
            return "joined"
        raise


def checks_at_the_top(opts: Any, steps: int, train_step: Callable[[int], None], every: Optional[int] = 1,
                      go_on: bool = False) -> Dict[str, Any]:
    """``steps`` steps of ``train_step(t)`` inside ``with distopt.join(*opts):``, with ``opts[0].check_drift()`` at
    the top of each step ``t`` that ``every`` divides but the first where ``every`` > 1 (in local SGD: right
    after a sync), or at none with ``every=None``. A rank that runs out of data first then waits in a shadow
    round, and a check on the others must not meet it there.

    Args:
        go_on: catch a check's RuntimeError and train on inside the block.

    Returns:
        ``checks``: the checks that ran; ``error``: the text of the first RuntimeError of a check (with ``go_on``)
        or the one that left the block, or None; ``errors``: how many; ``seconds``: from the start to the error
        that left the block, or to the end of the block.
    """
    import distopt  # in the ranks

    opts = opts if isinstance(opts, (list, tuple)) else [opts]
    checks, errors, start = 0, [], time.monotonic()
    try:
        with distopt.join(*opts):
            for t in range(steps):
                if every is not None and t % every == 0 and (every == 1 or t):
                    try:
                        opts[0].check_drift()
                        checks += 1
                    except RuntimeError as exc:
                        if not go_on:
                            raise
                        errors.append(str(exc))
                train_step(t)
    except RuntimeError as exc:
        errors.append(str(exc))
    return {"checks": checks, "error": errors[0] if errors else None, "errors": len(errors),
            "seconds": time.monotonic() - start}
