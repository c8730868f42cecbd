"""Semi-supervised label distribution learning as a fedsim learner: RankMatch and its baselines.

Paper: Kou et al., "RankMatch: A Novel Approach to Semi-Supervised Label Distribution Learning
Leveraging Rank Correlation between Labels", NeurIPS 2025, https://openreview.net/forum?id=Q8QMhJFSk4
(earlier version arXiv 2312.06343).  No code is public; the methods, their losses and every
reconstructed piece are documented in :mod:`clients.ldl.methods` and :mod:`clients.ldl.losses`.

The regime: instances carry a label *distribution* (:mod:`envs.ldl`: (a) digits/MNIST with
distributions from a cross-fitted teacher, (b) a synthetic tabular set); a small share is labelled
(``labelled_ratio``, e.g. 5/10/20 %), the rest is unlabelled.  A node trains a network whose softmax
is the predicted distribution with the labelled KL (plus the recipe's ranking loss) and, on its
unlabelled rows, the recipe's pseudo-distributions (:data:`clients.ldl.methods.RECIPES`).

**One round** = ``client.local_epochs`` epochs; a step takes ``client.batch_size`` labelled rows and
``mu × client.batch_size`` unlabelled rows (each pool reshuffled and cycled on its own), and an epoch
is one pass over the larger of the two pools — the same number of steps for every method, so the
baselines get the same optimisation budget (``client.local_steps`` sets it exactly).  Optimiser:
``client.optimizer/lr/momentum/weight_decay``, fresh each round, its learning rate decayed over the
rounds by FixMatch's cosine ``cos(7π (r−1) / 16 R)`` (``lr_schedule``); the unlabelled weight may
ramp up linearly over the first ``rampup_rounds`` rounds (off by default).
Before training, the node measures the pseudo-distributions its recipe builds from the received
global model on its unlabelled rows against their (never trained on) true distributions:
``pseudo_spearman``, ``pseudo_kendall``, ``pseudo_cosine``, ``pseudo_intersection`` (train metrics).

**Centralised** = one node with every labelled and unlabelled row.  **Federated**
(:func:`envs.ldl.federated_ldl`): the labelled rows sit on the first ``labelled_clients`` nodes
only; the unlabelled rows are spread over all nodes, non-IID by peak label (Dirichlet ``alpha``);
each node builds its pseudo-distributions locally from the global model; the server runs FedAvg
(weighted by the rows a node trained on: labelled + unlabelled, or labelled only for
``supervised``, whose unlabelled-only nodes do not train and weigh 0).  Measured pitfall: an
unlabelled-only node has no labelled anchor, and pure consistency training has a trivial optimum
(one constant prediction for every input).  With Adam (which normalises the tiny early consistency
gradients into full-size steps) 4 unlabelled-only nodes out of 6 drove the global model to constant
one-hot predictions within 15 rounds (test KL 0.63 -> 17); with SGD, a ramp-up of the unlabelled
weight (``rampup_rounds``) and a fixed number of local steps the federated runs learn
(``experiments/reproduce/rankmatch_fed.yaml``).

**Server evaluation** (``evaluate_global``, logged as ``eval/...`` every round): the six LDL
measures and Spearman/Kendall on the held-out test set, and the same eight measures of the
recipe's pseudo-distributions of the whole unlabelled pool under the global model
(``eval/pseudo_*``: the pseudo-labels the nodes will train on next round, pooled over nodes).
``final_report``: run means (rounds 1..R) of the pseudo-label measures (``ldl/pseudo_*_mean``), and
plots and a CSV of the test and pseudo-label measures per round (the final test measures are the
last round's ``eval/*``).

**Differential privacy** (``--eps``, sample-level DP-SGD through :class:`privacy.facade.PrivateTrainer`;
every method).  Unit of privacy: one training row of one node — a labelled row with its label
distribution, or an unlabelled row.  The step loss is rewritten as a mean of per-row terms over one
tensor tuple ``(x, target, labelled flag)`` (:func:`clients.ldl.methods.per_example_loss`): a
labelled row's KL + margin PRR, an unlabelled row's ``w_u`` × (KL + PRR) against its own
pseudo-distribution (its weak views under the model, or the round's snapshot of the global model on
it), with its own confidence mask.  Nothing couples rows: the PRR ranks *labels* within one row, the
mask thresholds the row's own peak mass, augmentations draw per row; one forward pass per batch.
**Deviations** under DP: a step is one Poisson batch over the node's pooled rows at one rate (expected
``batch_size × (1 + mu)`` rows, ``batch_size`` for ``supervised``), so its labelled:unlabelled mix is
the node's, not 1 : ``mu``; every row weighs 1 (unlabelled ``w_u``) in a mean over the whole batch,
where without DP the labelled and unlabelled terms are means over their own batches; BatchNorm
becomes GroupNorm (Opacus); the augmentation's noise scale comes from the server's test split, not
the pooled training rows (a statistic of every node's private rows); ``eval/pseudo_*`` (the server
scoring every node's unlabelled rows) is not computed.  A ``supervised`` node without labelled rows
never trains (an empty plan, ε 0).  Not protected: the train reply's loss parts and ``pseudo_*``
(diagnostics on private rows, and the unlabelled rows' simulated truths; released without DP under
``privacy.release=standard``, withheld under ``strict``), client-side evaluation (it scores the
node's unlabelled *training* rows: keep ``strategy.fraction_evaluate=0`` under DP), and the
server's test split.

The learner owns its data and model: ``cfg.data`` and ``cfg.model`` are ignored (the YAML leaves
them at their defaults); the data set and the network are set in ``client.params``.

The parts: :mod:`clients.ldl.environment` (data, split, node rows, augmentation, network),
:mod:`clients.ldl.training` (a node's round, plain or DP-SGD, and the evaluations) and
:mod:`clients.ldl.report` (set-up summary, run means, plots); this class composes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from clients.ldl import report, training
from clients.ldl.augment import Augment, AugmentParams
from clients.ldl.environment import DATASETS, LDLEnvironment, NodeData
from clients.ldl.methods import RECIPES, Recipe, Weights, recipe_of
from envs.ldl import ImageLDLParams, LDLData, LDLSplit, NodeRows, TabularLDLParams
from fedsim.config import ExperimentConfig
from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult
from fedsim.errors import ConfigError
from fedsim.registry import LEARNERS
from fedsim.seeding import derive_seed, seed_torch
from privacy.facade import PrivateTrainer
from privacy.plan import ClientPrivacyPlan

if TYPE_CHECKING:
    from fedsim.contracts.history import History


@dataclass
class LDLParams:
    """``client.params`` of the ``ldl`` learner."""

    method: str = "rankmatch"  # supervised | pseudo_label | fixmatch | avg_pseudo | rankmatch | rankmatch_margin
    dataset: str = "a"  # a: image LDL (image.*) | b: synthetic tabular LDL (tabular.*)
    image: ImageLDLParams = field(default_factory=ImageLDLParams)
    tabular: TabularLDLParams = field(default_factory=TabularLDLParams)
    labelled_ratio: float = 0.1  # share of the training pool that is labelled (5/10/20 % in the claims)
    test_fraction: float = 0.25  # held out for the server's evaluation
    # federated split (num_clients > 1)
    labelled_clients: int = 2  # the first this-many nodes hold the labelled rows
    alpha: float = 0.5  # Dirichlet concentration of the unlabelled rows over nodes, by peak label
    min_unlabelled: int = 10  # fewest unlabelled rows per node
    # optimisation (client.batch_size labelled rows per step, mu times as many unlabelled)
    mu: int = 4
    lr_schedule: str = "cosine"  # cosine: FixMatch's lr · cos(7π r / 16 R) over rounds r = 0..R-1 | constant
    # loss weights and knobs (clients.ldl.methods.Weights)
    unsup_weight: float = 1.0
    rampup_rounds: int = 0  # w_u grows linearly over the first this-many rounds (0 = full weight from round 1)
    sup_rank_weight: float = 0.1
    unsup_rank_weight: float = 0.1
    margin_scale: float = 1.0
    views: int = 4
    threshold: float = 0.0
    augment: AugmentParams = field(default_factory=AugmentParams)  # weak / strong view strengths
    # the network: auto = cnn for images, mlp for tabular (fedsim.models builders, params below)
    model: str = "auto"
    model_params: dict[str, Any] = field(default_factory=dict)

    @property
    def weights(self) -> Weights:
        return Weights(self.unsup_weight, self.sup_rank_weight, self.unsup_rank_weight, self.margin_scale,
                       self.views, self.threshold)

    def weights_at(self, server_round: int) -> Weights:
        """The weights of a round: ``unsup_weight`` ramped up linearly over ``rampup_rounds``."""
        ramp = min(1.0, server_round / self.rampup_rounds) if self.rampup_rounds > 0 else 1.0
        return replace(self.weights, unsup_weight=self.unsup_weight * ramp)


@LEARNERS.register("ldl", params=LDLParams, summary="semi-supervised label distribution learning (RankMatch, "
                                                    "FixMatch-style, pseudo-labelling, supervised KL)")
class LDLLearner(Learner):
    """Semi-supervised LDL on labelled + unlabelled rows per node; FedAvg of the whole network."""

    owns_environment = True  # the LDL data set and the network come from client.params
    supports_dp = True
    validation_split = True  # evaluation.validation_fraction: a hold-out of the training pool, logged as val/*
    privacy_unit = ("one training row of one node (a labelled row with its label distribution, or an unlabelled "
                    "row); the server's test split is not protected")

    def __init__(self, cfg: ExperimentConfig, params: LDLParams) -> None:
        super().__init__(cfg, params)
        self._dp: dict[int, PrivateTrainer] = {}
        self.recipe: Recipe = recipe_of(params.method)
        self.env = LDLEnvironment(cfg, params)

    # -- data and model (clients.ldl.environment) -------------------------------------------------
    @property
    def data(self) -> LDLData:
        return self.env.data

    @property
    def split(self) -> LDLSplit:
        return self.env.split

    @property
    def rows(self) -> list[NodeRows]:
        return self.env.rows

    def node(self, partition_id: int) -> NodeData:
        return self.env.node(partition_id)

    @property
    def augment(self) -> Augment:
        return self.env.augment

    @property
    def model(self) -> nn.Module:
        return self.env.model

    def build_network(self) -> nn.Module:
        return self.env.build_network()

    def _load(self, arrays: StateDict) -> nn.Module:
        model = self.model
        model.load_state_dict(arrays)
        return model

    # -- privacy (sample-level DP-SGD through privacy.facade) -------------------------------------------
    @property
    def sample_level_dp(self) -> bool:
        return self.env.sample_level_dp

    def dp_rows(self, partition_id: int) -> int:
        """Rows of the node's DP data: labelled, plus unlabelled when the recipe uses them."""
        node = self.node(partition_id)
        return len(node.x_l) + (len(node.x_u) if self.recipe.uses_unlabelled else 0)

    def dp_trainer(self, partition_id: int) -> PrivateTrainer:
        """The node's DP-SGD: :meth:`num_steps` logical steps of expected batch ``batch_size × (1 + mu)``
        (``batch_size`` without unlabelled rows), the rows a step takes without DP."""
        if partition_id not in self._dp:
            c = self.cfg.client
            node = self.node(partition_id)
            mixed = self.recipe.uses_unlabelled and len(node.x_u) > 0
            client = replace(c, batch_size=c.batch_size * ((1 + self.params.mu) if mixed else 1),
                             local_steps=self.num_steps(partition_id))
            self._dp[partition_id] = PrivateTrainer(replace(self.cfg, client=client))
        return self._dp[partition_id]

    def privacy_plan(self, partition_id: int) -> ClientPrivacyPlan:
        if self.num_steps(partition_id) == 0:  # supervised on an unlabelled-only node: never trains
            return ClientPrivacyPlan(0, 0.0, 0.0, 0, 0, 0.0)
        return self.dp_trainer(partition_id).plan(partition_id, self.dp_rows(partition_id))

    # -- checks -----------------------------------------------------------------------------------
    def preflight(self) -> None:
        p, cfg = self.params, self.cfg
        checks = [
            (p.dataset in DATASETS,
             f"client.params.dataset must be 'a' (image LDL) or 'b' (tabular LDL), got {p.dataset!r}"),
            (p.mu >= 1, f"client.params.mu must be >= 1, got {p.mu}"),
            (p.lr_schedule in ("cosine", "constant"),
             f"client.params.lr_schedule must be 'cosine' or 'constant', got {p.lr_schedule!r}"),
            (p.views >= 1, f"client.params.views must be >= 1, got {p.views}"),
            (min(p.unsup_weight, p.sup_rank_weight, p.unsup_rank_weight) >= 0,
             "client.params: unsup_weight, sup_rank_weight and unsup_rank_weight must be >= 0"),
            (p.rampup_rounds >= 0, f"client.params.rampup_rounds must be >= 0, got {p.rampup_rounds}"),
            (p.margin_scale >= 0, f"client.params.margin_scale must be >= 0, got {p.margin_scale}"),
            (0 <= p.threshold <= 1, f"client.params.threshold must be in [0, 1], got {p.threshold}"),
            (p.labelled_clients >= 1, f"client.params.labelled_clients must be >= 1, got {p.labelled_clients}"),
            (p.alpha > 0, f"client.params.alpha must be > 0, got {p.alpha}"),
            (p.min_unlabelled >= 1, f"client.params.min_unlabelled must be >= 1, got {p.min_unlabelled}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if p.method == "supervised" and cfg.num_clients > p.labelled_clients and cfg.strategy.fraction_train < 1:
            raise ConfigError("method=supervised trains only on labelled nodes, so a round that samples none of them "
                              "has nothing to average; use strategy.fraction_train=1")
        p.augment.check()
        self.rows  # builds the data and the splits now: their errors surface before the run
        try:
            self.model
        except ConfigError as exc:
            raise ConfigError(f"client.params.model_params: {exc}") from None
        if self.sample_level_dp:
            for pid in range(cfg.num_clients):
                self.privacy_plan(pid)

    # -- Learner API (clients.ldl.training) -------------------------------------------------------
    def init_arrays(self) -> StateDict:
        seed_torch(derive_seed(self.cfg.seed, "model-init"))
        return training.state_of(self.build_network())

    def num_steps(self, partition_id: int) -> int:
        """Optimiser steps a round costs this node (the same for every method)."""
        return training.num_steps(self.cfg.client, self.params.method, self.params.mu, self.node(partition_id))

    def lr_factor(self, server_round: int) -> float:
        """The round's learning-rate factor (FixMatch's cosine decay over the run's rounds, or 1)."""
        return training.lr_factor(self.params.lr_schedule, server_round, self.cfg.rounds)

    def local_work(self, partition_id: int) -> float:
        return float(self.num_steps(partition_id))

    def train(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        model, node = self._load(arrays), self.node(ctx.partition_id)
        lr = self.cfg.client.lr * self.lr_factor(ctx.server_round)
        r = training.start_round(model, node, self.recipe, self.params.weights_at(ctx.server_round), self.env, ctx,
                                 self.num_steps(ctx.partition_id), lr)
        if self.sample_level_dp:
            return training.train_private(r, ctx, self.dp_trainer(ctx.partition_id))
        return training.train_local(r, ctx, self.cfg.client.batch_size, self.params.mu)

    def evaluate(self, arrays: StateDict, ctx: NodeContext) -> EvalResult:
        """The six measures of the global model on the node's unlabelled rows (their truth is known offline)."""
        node = self.node(ctx.partition_id)
        return training.evaluate_node(self._load(arrays), node)

    def evaluate_global(self, arrays: StateDict) -> dict[str, float]:
        """Test-set measures (six + Spearman/Kendall) and the same of the recipe's pseudo-distributions of the pool."""
        return training.evaluate_server(self._load(arrays), self.env, self.recipe, self.params.weights)

    # -- the run's report (clients.ldl.report) ------------------------------------------------------
    def setup_summary(self) -> dict[str, Any]:
        return report.setup_summary(self.data, self.split, self.rows)

    def setup_artifacts(self, out_dir: Path) -> list[Path]:
        return report.setup_artifacts(self.data, self.rows, out_dir)

    def final_report(self, history: "History", out_dir: Path | None) -> tuple[dict[str, float], list[Path]]:
        metrics = report.pseudo_means(history)
        if metrics is None:
            return {}, []
        title = (f"{self.params.method}: {self.data.name}, {self.params.labelled_ratio:.0%} labelled, "
                 f"{self.cfg.num_clients} node(s), seed {self.cfg.seed}")
        return metrics, report.plots(history, out_dir, title) if out_dir is not None else []


__all__ = ["LDLLearner", "LDLParams", "NodeData", "RECIPES"]
