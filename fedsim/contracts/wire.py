"""The wire protocol: every key a strategy, a learner and the engine exchange in Flower records.

A strategy writes round-config keys (``ConfigRecord``) that a learner reads, and a learner writes
reply keys (``MetricRecord``/``ArrayRecord`` names) that a strategy and the engine read.  Each key
is defined here once, so the two sides cannot drift: a strategy and its learner both import the
constant, never each other.

Reply keys (learner -> strategy/engine)
    :data:`NUM_EXAMPLES`, :data:`UNIT_WEIGHT`, :data:`PARTITION_ID`.
Round-config keys (strategy -> learner)
    :data:`PROXIMAL_MU` (FedProx), :data:`TRANSFORM_KEY` and the FedPhoenix reset schedule
    (:data:`PHOENIX_SEED` ...), and the LoRA adapter names (:data:`LORA_A_SUFFIX` ...) that the LoRA
    strategies select from the arrays a LoRA model's learner sends.
"""

from __future__ import annotations

# -- replies ------------------------------------------------------------------------------------

#: Key in train/evaluate replies that FedAvg-style strategies weight by (Flower's default name).
NUM_EXAMPLES = "num-examples"
#: Key every train reply carries with value 1, for strategies that must average uniformly.
UNIT_WEIGHT = "unit-weight"
#: Key a node answers the engine's query with (used to order nodes canonically).
PARTITION_ID = "partition-id"
#: Round-config key of the current round (Flower's FedAvg family writes it).
SERVER_ROUND = "server-round"

# -- FedProx ------------------------------------------------------------------------------------

#: Round-config key of FedProx's proximal coefficient (the key Flower's ``FedProx`` strategy sends).
PROXIMAL_MU = "proximal-mu"

# -- model transforms (applied by the learner to the received model before local training) ------

#: Round-config key naming the transform(s) to apply, in order (see :mod:`fedsim.contracts.transforms`).
TRANSFORM_KEY = "transform"

#: FedPhoenix's stochastic filter reset (:mod:`algorithms.fedphoenix`): the transform's name and
#: the round-config keys of its schedule, sent by ``strategies.fedphoenix``.
PHOENIX = "phoenix-reset"
PHOENIX_SEED = "phoenix-seed"
PHOENIX_THETA = "phoenix-theta"
PHOENIX_RESET_ROUNDS = "phoenix-reset-rounds"
PHOENIX_DISTRIBUTION = "phoenix-distribution"
PHOENIX_SCALE = "phoenix-scale"
PHOENIX_TOTAL_ROUNDS = "phoenix-total-rounds"  # informational (r_s is already absolute)

# -- LoRA adapters (array names in the state dict a LoRA model's learner sends) -----------------

LORA_A_SUFFIX = "lora_A.weight"
LORA_B_SUFFIX = "lora_B.weight"
LORA_BASE_SUFFIX = "base_layer.weight"
#: Round-config keys telling a LoRA learner which factors to train (FFA-LoRA/FedSVD freeze A).
LORA_TRAIN_A, LORA_TRAIN_B = "lora-train-A", "lora-train-B"
