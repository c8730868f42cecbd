"""Server-side algorithms: Flower Message-API strategies, registered by name."""

from strategies import ckarl, fedmut, fedphoenix, fedprox, flower_builtin, lora  # noqa: F401  (register themselves)
from strategies.base import StrategyContext  # noqa: F401
