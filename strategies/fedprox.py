"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020,
arXiv:1812.06127): FedAvg on the server, a proximal term in every client's local objective.

This is Flower's own ``FedProx`` Message-API strategy, registered for experiment YAML.  It sends
``"proximal-mu"`` in each training round's ``ConfigRecord``; the supervised learner
(:mod:`clients.supervised`) then minimises ``CE(w) + (mu/2) * ||w - w_global||^2`` over the
trainable parameters, ``w_global`` being the model as received.

Departures: none on the server.  Flower's docstring sketch writes the term with ``norm(2)`` (not
squared); we use the paper's squared norm, as Flower's ``baselines/fedprox`` does.  The FedPhoenix
code's FedProx baseline uses ``prox_alpha = 0.01``, our default ``mu``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.serverapp.strategy import FedProx

from fedsim.errors import ConfigError
from fedsim.registry import STRATEGIES
from fedsim.contracts.strategy import StrategyContext


@dataclass
class FedProxParams:
    mu: float = 0.01  # proximal coefficient (0 = FedAvg)


@STRATEGIES.register("fedprox", params=FedProxParams,
                     summary="Flower's FedProx (Li et al., 2020): FedAvg + proximal term in the local loss")
def build_fedprox(ctx: StrategyContext, params: FedProxParams) -> FedProx:
    if params.mu < 0:
        raise ConfigError(f"strategy.params.mu must be >= 0, got {params.mu}")
    return FedProx(
        **ctx.fedavg_kwargs(),
        proximal_mu=params.mu,
    )
