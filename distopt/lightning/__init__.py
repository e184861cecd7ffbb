"""distopt under Lightning: ``Trainer(strategy=distopt.lightning.DistoptStrategy(...))``.

Needs pytorch-lightning (``pip install "distopt[lightning]"``); nothing else in distopt
imports this package, so distopt works without it.
"""
try:
    import pytorch_lightning  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "distopt.lightning needs pytorch-lightning: pip install \"distopt[lightning]\" "
        "(or pip install pytorch-lightning)") from exc

from .strategy import RANKS_KEY, DistoptStrategy

__all__ = ["DistoptStrategy", "RANKS_KEY"]
