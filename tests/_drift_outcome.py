"""What ``opt.check_drift()`` does inside a join block, in a word: shared by the local SGD and streaming tests."""
from typing import Any

__all__ = ["drift_outcome"]


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
