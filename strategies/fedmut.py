"""FedMut (Hu et al., "FedMut: Generalized Federated Learning via Stochastic Mutation", AAAI 2024,
https://ojs.aaai.org/index.php/AAAI/article/view/29146): each sampled client starts from its own
*mutated* copy of the global model, spread around it along the last global update.

With ``w_t`` the current global model and ``w_{t-1}`` the one before the last aggregation, client j
of the m sampled this round receives, for every floating-point tensor k of the state dict,

    w_j[k] = w_t[k] + alpha * c[k, j] * (w_t[k] - w_{t-1}[k]),

where, independently for each tensor k, the coefficients ``c[k, :]`` are a random arrangement of
``floor(m/2)`` times ``+1`` and ``floor(m/2)`` times ``-1 + beta_t``; with m odd the last sampled
client gets the plain ``w_t``.  ``beta_t = acc_rate * (1 - min(t / acc_bound, 1))`` is the authors'
"mutation acceleration" (t = the 0-based index of the round that produced ``w_t``, i.e. Flower round
- 2), which tilts the spread forward along the update early on and vanishes after ``acc_bound``
rounds; from then on (or with ``acc_rate = 0``) the mutated copies are balanced: their mean is
exactly ``w_t``.  Round 1 has no previous global and sends the plain model to everyone.  The server
aggregates the local models with FedAvg.

Reference code: ``HMHelloWorld/FedMut`` (``Algorithm/Training_FedMut.py::FedMut, mutation_spread``,
``utils/options.py``: ``radius = 4.0``, ``mut_acc_rate = 0.3``, ``mut_bound = 50``).  Where this
departs from it:

* aggregation is Flower's sample-size-weighted FedAvg; the authors' FedMut averages the local
  models unweighted (``Aggregation(w_locals, None)``), while their FedAvg/FedPhoenix weight by size
  — weighted here keeps the four methods comparable;
* integer buffers (``num_batches_tracked``) are not mutated (the authors add a float to them);
* random numbers: the sign arrangement comes from a NumPy generator seeded by
  ``derive_seed(root_seed, "fedmut-mutation", round)`` instead of Python's global ``random``, and
  copy j goes to the j-th sampled node (fedsim's grid orders nodes by partition id, so both engines
  give the same copy to the same partition); the authors' commented-out adaptive radius is not used.

Stability note: the mutation extrapolates the last global update by ``alpha``; with few clients per
round on strongly non-IID data that update is large and noisy, and the authors' ``alpha = 4``
diverges (``experiments/fedmut.yaml``: 2 clients per round, Dirichlet(0.3), NaN from round 6), so
that experiment sets ``alpha = 2``.  With 10 clients per round ``alpha = 4`` trains stably here too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedsim.errors import ConfigError
from fedsim.registry import STRATEGIES
from fedsim.seeding import derive_seed
from fedsim.contracts.strategy import StrategyContext


@dataclass
class FedMutParams:
    alpha: float = 4.0  # mutation strength ("radius" in the authors' code)
    acc_rate: float = 0.3  # mutation acceleration beta_0 ("mut_acc_rate"); 0 = balanced around w_t
    acc_bound: int = 50  # rounds over which the acceleration decays to 0 ("mut_bound")


def mutation_coefficients(num_tensors: int, num_clients: int, beta: float, rng: np.random.Generator) -> np.ndarray:
    """``c[k, j]``: per tensor k, a random arrangement of floor(m/2) x (+1) and floor(m/2) x (-1+beta);
    with m odd the last column is 0 (that client gets the plain global model)."""
    half = num_clients // 2
    coeffs = np.zeros((num_tensors, num_clients))
    base = np.array([1.0] * half + [-1.0 + beta] * half)
    for k in range(num_tensors):
        coeffs[k, : 2 * half] = rng.permutation(base)
    return coeffs


def mutate(global_sd: dict[str, torch.Tensor], previous_sd: dict[str, torch.Tensor], alpha: float,
           coeffs: np.ndarray) -> list[dict[str, torch.Tensor]]:
    """One mutated copy of ``global_sd`` per column of ``coeffs`` (rows follow the state-dict order)."""
    copies: list[dict[str, torch.Tensor]] = [{} for _ in range(coeffs.shape[1])]
    for k, (key, w) in enumerate(global_sd.items()):
        if not torch.is_floating_point(w):
            for c in copies:
                c[key] = w
            continue
        delta = w - previous_sd[key]
        for j, c in enumerate(copies):
            c[key] = w + delta * (alpha * float(coeffs[k, j])) if coeffs[k, j] != 0 else w
    return copies


class FedMut(FedAvg):
    """FedAvg that sends each sampled client a mutated copy of the global model (module docstring)."""

    whole_model_updates = False  # fedsim.contracts.strategy.WHOLE_MODEL_UPDATES

    def __init__(self, *, root_seed: int, alpha: float = 4.0, acc_rate: float = 0.3, acc_bound: int = 50,
                 **fedavg_kwargs) -> None:
        super().__init__(**fedavg_kwargs)
        self.root_seed = root_seed
        self.alpha = alpha
        self.acc_rate = acc_rate
        self.acc_bound = acc_bound
        self._round_start: ArrayRecord | None = None  # w_t as sent this round
        self._previous: ArrayRecord | None = None  # w_{t-1}: the global before the last aggregation

    def acceleration(self, server_round: int) -> float:
        """beta for the copies sent in ``server_round`` (the authors' 0-based iter = round - 2)."""
        it = server_round - 2
        return self.acc_rate * (1.0 - min(it / self.acc_bound, 1.0)) if self.acc_bound > 0 else 0.0

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._round_start = arrays
        if not messages or self._previous is None:
            return messages  # round 1: no update direction yet, everyone gets w_t
        global_sd = arrays.to_torch_state_dict()
        previous_sd = self._previous.to_torch_state_dict()
        rng = np.random.default_rng(derive_seed(self.root_seed, "fedmut-mutation", server_round))
        coeffs = mutation_coefficients(len(global_sd), len(messages), self.acceleration(server_round), rng)
        out = []
        for msg, sd in zip(messages, mutate(global_sd, previous_sd, self.alpha, coeffs)):
            content = RecordDict({self.arrayrecord_key: ArrayRecord(sd), self.configrecord_key: config})
            out.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=msg.metadata.dst_node_id))
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            self._previous = self._round_start  # keep w_{t-1} for the next round's direction
        return arrays, metrics


@STRATEGIES.register("fedmut", params=FedMutParams,
                     summary="FedMut (Hu et al., AAAI 2024): per-client mutated global models + FedAvg")
def build_fedmut(ctx: StrategyContext, params: FedMutParams) -> FedMut:
    if params.acc_bound < 0:
        raise ConfigError(f"strategy.params.acc_bound must be >= 0, got {params.acc_bound}")
    return FedMut(
        root_seed=ctx.cfg.seed,
        alpha=params.alpha,
        acc_rate=params.acc_rate,
        acc_bound=params.acc_bound,
        **ctx.fedavg_kwargs(),
    )
