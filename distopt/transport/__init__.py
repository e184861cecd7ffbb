"""What sits directly on ``torch.distributed``, under the engine, the collectives and the launcher.

- :mod:`~distopt.transport.private_groups`: the private process groups the wrappers talk on;
- :mod:`~distopt.transport.waiting`: the bounded wait for one collective;
- :mod:`~distopt.transport.stalls`: the stall inspector, which names the ranks a wait is stuck on.
"""
from .stalls import StallError

__all__ = ["StallError"]
