"""FedPhoenix ("Rising from Ashes: Generalized Federated Learning via Dynamic Parameter Reset",
NeurIPS 2025, OpenReview ``QkqQSf1REo``): every sampled client trains from its own copy of the
global model in which a few convolution filters have been randomly redrawn.

Each round, each sampled client gets an independent reset: in every ``Conv2d`` layer that the
"stair" schedule still resets, ``floor(theta * out_channels)`` output filters chosen at random are
redrawn from N(mu, sigma^2), mu and sigma being the mean and std of that layer's current weight
(:func:`algorithms.fedphoenix.phoenix_reset`).  Layer d of L (registration order, shallow to deep) is
reset while ``round < (d+1) * r_s / L`` (authors' 0-based round = Flower round - 1), so shallow
layers stop first and the rounds after ``r_s`` are plain FedAvg.  The server aggregates the
clients' models with sample-size-weighted FedAvg.

How it is built: the server keeps one model and sends it unchanged; what differs per client is a
reset seed in the message's ``ConfigRecord`` (with theta, r_s, the distribution and the total
rounds), and the client applies the reset before local training through the learner's transform
hook.  The seed is ``derive_seed(root_seed, "phoenix-reset", server_round, i)`` with ``i`` the
node's position in ``grid.get_node_ids()``, which fedsim's grid orders by partition id, so both
engines (whose raw node ids differ) reset the same filters of the same partitions.  Once no layer is
reset any more (round - 1 >= r_s) the strategy sends exactly FedAvg's messages.

Reference code: the authors' supplementary code as found in the third-party copies
``binhu6978-rgb/FedPhoenix-{new,finish}`` (``Algorithm/Phoenix_util.py::reset_kernels_and_neurons_stair``,
``utils/options.py``, ``AutoRun.py``).  Where this departs from it:

* random numbers: the authors draw filter indices with Python's global ``random.sample`` and the
  new values from torch's global RNG; here one seeded ``torch.Generator`` per (round, client) draws
  both, so the same seed gives the same reset in any process (a different stream, same law);
* the reset runs on the client instead of on server-side copies, which is equivalent (the reset
  depends only on the global model and the seed) and keeps bandwidth and server memory as FedAvg's;
* defaults: theta = 1/64 (``--reset`` default; ``AutoRun.py`` uses 2/64), r_s = 5/6 of the rounds
  (their 1000 of 1200); their ``fc_reset_ratio = 0`` is fixed here (Linear layers never reset);
* the options ``uniform`` (U(mu-sigma, mu+sigma)), ``kaiming_uniform`` and ``kaiming_normal``
  follow the same function; ``scale`` is their ``scale_factor``.

Differential privacy: the reset is data-independent (it depends on the global model, which is
already public to the client, and on a seed), so under DP-SGD it is post-processing of released
models and consumes no privacy budget; the DP path itself lives in the privacy layer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from algorithms.fedphoenix import DISTRIBUTIONS, any_layer_reset
from fedsim.contracts.wire import (
    PHOENIX,
    PHOENIX_DISTRIBUTION,
    PHOENIX_RESET_ROUNDS,
    PHOENIX_SCALE,
    PHOENIX_SEED,
    PHOENIX_THETA,
    PHOENIX_TOTAL_ROUNDS,
    TRANSFORM_KEY,
)
from fedsim.errors import ConfigError
from fedsim.registry import STRATEGIES
from fedsim.seeding import derive_seed
from fedsim.contracts.strategy import StrategyContext

log = logging.getLogger("fedsim")


@dataclass
class FedPhoenixParams:
    theta: float = 1 / 64  # share of each conv layer's output filters reset per client (θ)
    reset_rounds: Optional[float] = None  # r_s: rounds with resets (stair length); None = reset_fraction x rounds
    reset_fraction: float = 5 / 6  # r_s as a share of the rounds when reset_rounds is unset (1000/1200)
    distribution: str = "normal"  # normal (N(μ,σ²)) | uniform (μ±σ) | kaiming_uniform | kaiming_normal
    scale: float = 1.0  # the authors' scale_factor on σ (or on the Kaiming bound)


class FedPhoenix(FedAvg):
    """FedAvg whose training messages carry a per-client filter-reset seed (see module docstring)."""

    def __init__(self, *, root_seed: int, theta: float, reset_rounds: float, total_rounds: int,
                 distribution: str = "normal", scale: float = 1.0, **fedavg_kwargs) -> None:
        super().__init__(**fedavg_kwargs)
        self.root_seed = root_seed
        self.theta = theta
        self.reset_rounds = reset_rounds
        self.total_rounds = total_rounds
        self.distribution = distribution
        self.scale = scale
        self._checked_widths = False

    def reset_seed(self, server_round: int, node_index: int) -> int:
        return derive_seed(self.root_seed, "phoenix-reset", server_round, node_index)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if not messages or not any_layer_reset(server_round, self.reset_rounds):
            return messages  # past r_s: exactly FedAvg
        self._warn_if_too_narrow(arrays)
        # position in the canonical (partition-ordered) node list, identical in every engine
        position = {node_id: i for i, node_id in enumerate(grid.get_node_ids())}
        out = []
        for msg in messages:
            node_id = msg.metadata.dst_node_id
            cfg = ConfigRecord(dict(config))  # config already holds "server-round"
            cfg[TRANSFORM_KEY] = PHOENIX
            cfg[PHOENIX_SEED] = self.reset_seed(server_round, position[node_id])
            cfg[PHOENIX_THETA] = float(self.theta)
            cfg[PHOENIX_RESET_ROUNDS] = float(self.reset_rounds)
            cfg[PHOENIX_TOTAL_ROUNDS] = int(self.total_rounds)
            cfg[PHOENIX_DISTRIBUTION] = self.distribution
            cfg[PHOENIX_SCALE] = float(self.scale)
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg})
            out.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node_id))
        return out

    def _warn_if_too_narrow(self, arrays: ArrayRecord) -> None:
        """Say once if no 4-D (conv) weight is wide enough for floor(θ·out_channels) >= 1."""
        if self._checked_widths:
            return
        self._checked_widths = True
        widths = [arr.shape[0] for arr in arrays.values() if len(arr.shape) == 4]
        if not any(int(w * self.theta) >= 1 for w in widths):
            log.warning("FedPhoenix: θ=%.4g resets no filter in conv layers of widths %s "
                        "(floor(θ·out_channels) = 0); the run is plain FedAvg", self.theta, widths or "none")


@STRATEGIES.register("fedphoenix", params=FedPhoenixParams,
                     summary="FedPhoenix (NeurIPS 2025): per-client stochastic conv-filter reset + FedAvg")
def build_fedphoenix(ctx: StrategyContext, params: FedPhoenixParams) -> FedPhoenix:
    if not 0.0 <= params.theta <= 1.0:
        raise ConfigError(f"strategy.params.theta must be in [0, 1], got {params.theta}")
    if params.distribution not in DISTRIBUTIONS:
        raise ConfigError(f"strategy.params.distribution must be one of {', '.join(DISTRIBUTIONS)}, "
                          f"got {params.distribution!r}")
    if params.reset_rounds is not None and params.reset_rounds < 0:
        raise ConfigError(f"strategy.params.reset_rounds must be >= 0, got {params.reset_rounds}")
    if not 0.0 <= params.reset_fraction <= 1.0:
        raise ConfigError(f"strategy.params.reset_fraction must be in [0, 1], got {params.reset_fraction}")
    cfg = ctx.cfg
    reset_rounds = params.reset_rounds if params.reset_rounds is not None else params.reset_fraction * cfg.rounds
    return FedPhoenix(
        root_seed=cfg.seed,
        theta=params.theta,
        reset_rounds=float(reset_rounds),
        total_rounds=cfg.rounds,
        distribution=params.distribution,
        scale=params.scale,
        **ctx.fedavg_kwargs(),
    )
