"""The contracts between fedsim's parts, in one home.

* :mod:`fedsim.contracts.learner` -- the node-side :class:`Learner` interface, its optional
  capabilities (privacy plan, cohort training) and what it is given (:class:`NodeContext`) and returns;
* :mod:`fedsim.contracts.strategy` -- what a strategy builder receives (:class:`StrategyContext`);
* :mod:`fedsim.contracts.history` -- the round history (:class:`RoundRecord`, :class:`History`);
* :mod:`fedsim.contracts.wire` -- every key a strategy, a learner and the engine exchange;
* :mod:`fedsim.contracts.transforms` -- model transforms a strategy asks a learner to apply.

Plugins (``strategies/``, ``clients/``, ``envs/``, ``central/``) import from here; the core never
imports a plugin (it looks components up by name in :mod:`fedsim.registry`).  Maths that a
strategy and its learner share lives in ``algorithms/<name>``, which both import.
"""

from fedsim.contracts.history import History, RoundRecord
from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult
from fedsim.contracts.strategy import StrategyContext

__all__ = ["EvalResult", "History", "Learner", "NodeContext", "RoundRecord", "StateDict", "StrategyContext",
           "TrainResult"]
