"""Node-side learners (plain PyTorch), wrapped into Flower ClientApps by the engine."""

from clients import supervised  # noqa: F401  (registers the "supervised" learner)
from clients import tta_learner  # noqa: F401  (registers the "tta" learner)
from clients import rl_learner  # noqa: F401  (registers the "ckarl" learner)
from clients import lora_meta  # noqa: F401  (registers the "lora_meta" learner)
from clients import graph_learner  # noqa: F401  (registers the "imgda" learner)
from clients import ldl_learner  # noqa: F401  (registers the "ldl" learner)
from clients.base import EvalResult, Learner, NodeContext, StateDict, TrainResult  # noqa: F401
