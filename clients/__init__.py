"""Node-side learners (plain PyTorch), wrapped into Flower ClientApps by the engine.

Each learner module registers itself when imported; :data:`fedsim.plugins.BUILTINS` says which, so
importing this package imports no learner.
"""

from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult  # noqa: F401
