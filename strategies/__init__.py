"""Server-side algorithms: Flower Message-API strategies, registered by name.

Each strategy module registers itself when imported; :data:`fedsim.plugins.BUILTINS` says which, so
importing this package imports no strategy.
"""

from fedsim.contracts.strategy import StrategyContext  # noqa: F401
