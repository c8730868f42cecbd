"""The node-side learner contract (the core's; plugins in ``clients/`` implement it).

A :class:`Learner` is plain PyTorch: the engine wraps it into a Flower ``ClientApp``.  One learner
object is built per process and per run (see :mod:`fedsim.engine.runtime`) and serves every node
that process simulates, so models, optimiser shapes and data stay resident between rounds and only
parameters move.  Anything a node must remember between rounds (continual and test-time learners,
privacy ledgers) lives in ``ctx.state``, Flower's per-node ``RecordDict`` which persists for the
whole run in both engines.

The contract is deliberately wider than supervised classification:

* ``train``/``evaluate`` get a :class:`NodeContext` with the round number, so data may change with
  the round (task and domain streams);
* a learner owns its environment (labelled arrays, a gymnasium task, a PyG graph ...), built from
  the experiment config through the registries, so RL, graph and semi-supervised learners fit;
* ``init_arrays`` and ``evaluate_global`` give the server its initial model and its centralised
  evaluation, so centralised mode (one client, no aggregation) is the same code path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from flwr.app import RecordDict

from fedsim.config import ExperimentConfig
from fedsim.seeding import derive_seed

if TYPE_CHECKING:
    from fedsim.contracts.history import History

StateDict = dict[str, torch.Tensor]


class CapabilityMissing(NotImplementedError):
    """A caller used an optional capability (privacy plan, cohort training) that this learner does
    not declare; callers check ``supports_dp`` / :meth:`Learner.cohort_refusal` first."""


def local_steps(num_examples: int, cfg: ExperimentConfig) -> int:
    """Optimiser steps of one client's round: ``client.local_steps`` when set, else
    ``client.local_epochs`` passes of ``⌈n / client.batch_size⌉`` batches.  The one formula that
    training and the privacy plan (which calibrates σ for these steps) both use."""
    if cfg.client.local_steps is not None:
        return cfg.client.local_steps
    return cfg.client.local_epochs * -(-num_examples // cfg.client.batch_size)


@dataclass
class NodeContext:
    """What a learner knows about the node and round it is serving."""

    partition_id: int
    num_partitions: int
    server_round: int
    root_seed: int
    state: RecordDict = field(default_factory=RecordDict)  # persists per node across rounds
    config: Mapping[str, Any] = field(default_factory=dict)  # the strategy's round config

    def seed(self, stream: str) -> int:
        """A seed unique to (root seed, stream, round, node): identical in every engine."""
        return derive_seed(self.root_seed, stream, self.server_round, self.partition_id)


@dataclass
class TrainResult:
    arrays: StateDict  # what is sent back to the server (detached copies)
    num_examples: int  # weight for sample-size-weighted aggregation
    metrics: dict[str, float] = field(default_factory=dict)
    #: True when ``arrays`` are CPU tensors that nothing else holds or will write (fresh copies made for
    #: this reply): the engine then wraps their memory instead of copying it once more.  Leave False
    #: when unsure; a learner that returns live model tensors must (the reply would change with them).
    owned: bool = False


@dataclass
class EvalResult:
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


class Learner(ABC):
    """Base class of node-side learners; subclasses register under ``fedsim.registry.LEARNERS``."""

    supports_dp: bool = False  # True when the learner honours cfg.privacy (DP-SGD)
    #: True when the learner keeps its model and data on ``engine.device`` (:mod:`fedsim.device`);
    #: any other learner runs on the CPU and a GPU ``engine.device`` is refused before the run.
    supports_device: bool = False
    #: Without DP: why (one line, shown when a user asks for --eps); with DP: what one protected unit is.
    privacy_unit: str = ""
    #: True when the learner honours ``evaluation.validation_fraction`` (a server validation split it
    #: reports as ``val/*``, what ``fedsim reproduce``'s tuning selects on).
    validation_split: bool = False
    #: True when the learner builds its own environment and model from ``client.params`` (RL, graphs ...):
    #: ``cfg.data`` and ``cfg.model`` are then unused and not logged as the run's params.
    owns_environment: bool = False

    def __init__(self, cfg: ExperimentConfig, params: Any) -> None:
        self.cfg = cfg
        self.params = params

    @abstractmethod
    def init_arrays(self) -> StateDict:
        """The initial global model, seeded from the root seed."""

    @abstractmethod
    def train(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        """Local training from the global ``arrays``; returns the update to aggregate."""

    @abstractmethod
    def evaluate(self, arrays: StateDict, ctx: NodeContext) -> EvalResult:
        """Client-side evaluation of ``arrays`` on the node's own test data."""

    # -- optional capabilities (declared here; a learner overrides what it supports) --------------

    def privacy_plan(self, partition_id: int) -> Any:
        """Sample-level DP: this client's ``privacy.plan.ClientPrivacyPlan`` (noise multiplier, sampling
        rate, steps per round), which the server's privacy ledger charges (called only when ``supports_dp`` and ``cfg.privacy.enabled``)."""
        raise CapabilityMissing(f"learner {type(self).__name__} has no sample-level privacy plan")

    def cohort_refusal(self, ctxs: list[NodeContext], auto: bool) -> str | None:
        """Why this cohort of clients cannot be trained together by :meth:`train_cohort` (None: it can).

        ``auto`` (``engine.vectorise=auto``) also refuses cohorts where batching is exact but not faster.
        """
        return f"learner {type(self).__name__} does not train cohorts"

    def train_cohort(self, arrays_list: list[StateDict], ctxs: list[NodeContext], chunk: int) -> list[TrainResult]:
        """``[self.train(a, c) for a, c in zip(arrays_list, ctxs)]`` computed together, in chunks of at
        most ``chunk`` clients (``engine.vectorise``); only called where :meth:`cohort_refusal` is None."""
        raise CapabilityMissing(self.cohort_refusal(ctxs, auto=False))

    def seed_streams(self) -> tuple[str, ...]:
        """The :meth:`NodeContext.seed` streams one training round of this learner derives (e.g. ``("torch",
        "batches")``); the local engine derives them for a whole round in one vectorised pass
        (:func:`fedsim.seeding.prime_seeds`, the same integers).  Optional: a stream left out is derived
        when the learner asks for it."""
        return ()

    def local_work(self, partition_id: int) -> float:
        """Units of local work (e.g. optimiser steps) a training round costs this node; the simulated
        system model (``engine.system``) turns it into simulated seconds."""
        return 1.0

    def preflight(self) -> None:
        """Checks that need the learner's data (e.g. privacy calibration); raise ConfigError."""

    def evaluate_global(self, arrays: StateDict) -> dict[str, float]:
        """Server-side (centralised) evaluation on held-out data; empty if the learner has none."""
        return {}

    def setup_artifacts(self, out_dir: Path) -> list[Path]:
        """Files describing the run's setup (e.g. a label-histogram plot) to log once."""
        return []

    def setup_summary(self) -> dict[str, float]:
        """Scalar facts about the setup (dataset sizes ...) to log as params."""
        return {}

    def final_report(self, history: "History", out_dir: Path | None) -> tuple[dict[str, float], list[Path]]:
        """Run-level metrics computed from the whole history (e.g. a stream's per-cycle accuracy, forgetting)
        and plot files written under ``out_dir`` (``None`` when nothing is tracked: write no files).

        The runner adds the metrics to the last round's record (so they show in the summary and in
        claim checks) and logs both to MLflow.
        """
        return {}, []
