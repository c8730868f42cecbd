"""Server-side algorithms: Flower Message-API strategies, registered by name."""

from strategies import flower_builtin  # noqa: F401  (registers fedavg)
from strategies.base import StrategyContext  # noqa: F401
