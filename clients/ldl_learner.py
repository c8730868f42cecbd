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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult
from clients.ldl.augment import Augment, AugmentParams, augment_for
from clients.ldl.measures import MEASURES, RANKS, ldl_measures
from clients.ldl.methods import (RECIPES, Recipe, Weights, per_example_loss, predict, pseudo_distributions, recipe_of,
                                 step_loss)
from clients.supervised import iterate_batches, make_dp_compatible, make_optimizer
from envs.ldl import (ImageLDLParams, LDLData, LDLSplit, NodeRows, TabularLDLParams, federated_ldl, image_ldl,
                      split_ldl, tabular_ldl)
from fedsim.config import ExperimentConfig
from fedsim.errors import ConfigError
from fedsim.models import build_model
from fedsim.registry import LEARNERS
from fedsim.seeding import derive_seed, seed_torch
from privacy.facade import PrivateTrainer
from privacy.plan import ClientPrivacyPlan

if TYPE_CHECKING:
    from fedsim.contracts.history import History

DATASETS = ("a", "b")  # a: image LDL (digits / MNIST), b: synthetic tabular LDL
#: The measures of the pseudo-distributions reported as train metrics (and ``eval/pseudo_*`` all eight).
PSEUDO_TRAIN = ("spearman", "kendall", "cosine", "intersection")
LOSS_KEYS = ("sup_kl", "sup_rank", "unsup_kl", "unsup_rank")


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


@dataclass
class NodeData:
    """A node's tensors: labelled rows with their distributions, unlabelled rows (and their truth, to measure)."""

    x_l: torch.Tensor
    d_l: torch.Tensor
    x_u: torch.Tensor
    d_u: torch.Tensor  # never used in training


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
        self._data: LDLData | None = None
        self._split: LDLSplit | None = None
        self._rows: list[NodeRows] | None = None
        self._nodes: dict[int, NodeData] = {}
        self._model: nn.Module | None = None
        self._augment: Augment | None = None

    # -- data and model ---------------------------------------------------------------------------
    @property
    def data(self) -> LDLData:
        if self._data is None:
            p, seed = self.params, self.cfg.seed
            self._data = (image_ldl(p.image, seed, "client.params.image") if p.dataset == "a"
                          else tabular_ldl(p.tabular, seed, "client.params.tabular"))
        return self._data

    @property
    def split(self) -> LDLSplit:
        if self._split is None:
            p = self.params
            try:
                self._split = split_ldl(self.data, p.labelled_ratio, p.test_fraction, derive_seed(self.cfg.seed, "ldl"),
                                        self.cfg.evaluation.validation_fraction)
            except ConfigError as exc:
                raise ConfigError(f"client.params: {exc}") from None
        return self._split

    @property
    def rows(self) -> list[NodeRows]:
        if self._rows is None:
            p = self.params
            n_u, k = len(self.split.unlabelled), self.cfg.num_clients
            if k > 1 and p.min_unlabelled * k > n_u:
                raise ConfigError(f"client.params.min_unlabelled={p.min_unlabelled} x {k} clients exceeds the "
                                  f"{n_u} unlabelled rows; lower it or num_clients")
            try:
                self._rows = federated_ldl(self.data, self.split, k, p.labelled_clients, p.alpha, p.min_unlabelled,
                                           derive_seed(self.cfg.seed, "ldl-clients"))
            except ConfigError as exc:
                raise ConfigError(f"client.params (labelled_clients / alpha / min_unlabelled): {exc}") from None
        return self._rows

    def node(self, partition_id: int) -> NodeData:
        if partition_id not in self._nodes:
            r, x, d = self.rows[partition_id], self.data.x, self.data.d
            t = torch.from_numpy
            self._nodes[partition_id] = NodeData(t(x[r.labelled]), t(d[r.labelled]), t(x[r.unlabelled]),
                                                 t(d[r.unlabelled]))
        return self._nodes[partition_id]

    @property
    def augment(self) -> Augment:
        """Augmentation scaled by the training pool's statistics; under DP by the server's test split's
        (the pool's std would be a statistic of every node's private rows, outside the ledger)."""
        if self._augment is None:
            rows = (self.split.test if self.sample_level_dp
                    else np.concatenate([self.split.labelled, self.split.unlabelled]))
            self._augment = augment_for(self.data.x[rows], self.params.augment)
        return self._augment

    def build_network(self) -> nn.Module:
        p, data = self.params, self.data
        name = p.model if p.model != "auto" else ("cnn" if len(data.input_shape) == 3 else "mlp")
        model = build_model(name, dict(p.model_params), data.input_shape, data.num_labels)
        return make_dp_compatible(model) if self.sample_level_dp else model  # BatchNorm -> GroupNorm

    # -- privacy (sample-level DP-SGD through privacy.facade) -------------------------------------------
    @property
    def sample_level_dp(self) -> bool:
        return self.cfg.privacy.enabled and self.cfg.privacy.level == "sample"

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

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            self._model = self.build_network()
        return self._model

    def _load(self, arrays: StateDict) -> nn.Module:
        model = self.model
        model.load_state_dict(arrays)
        return model

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

    # -- Learner API ------------------------------------------------------------------------------
    def init_arrays(self) -> StateDict:
        seed_torch(derive_seed(self.cfg.seed, "model-init"))
        return {k: v.detach().clone() for k, v in self.build_network().state_dict().items()}

    def num_steps(self, partition_id: int) -> int:
        """Optimiser steps a round costs this node (the same for every method)."""
        c, n = self.cfg.client, self.node(partition_id)
        if self.params.method == "supervised" and len(n.x_l) == 0:
            return 0
        if c.local_steps is not None:
            return c.local_steps
        per_epoch = max(-(-len(n.x_u) // (self.params.mu * c.batch_size)), -(-len(n.x_l) // c.batch_size))
        return c.local_epochs * per_epoch

    def lr_factor(self, server_round: int) -> float:
        """The round's learning-rate factor (FixMatch's cosine decay over the run's rounds, or 1)."""
        if self.params.lr_schedule == "constant":
            return 1.0
        return math.cos(7 * math.pi * (server_round - 1) / (16 * self.cfg.rounds))

    def local_work(self, partition_id: int) -> float:
        return float(self.num_steps(partition_id))

    def train(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        model, node, recipe = self._load(arrays), self.node(ctx.partition_id), self.recipe
        weights = self.params.weights_at(ctx.server_round)
        seed_torch(ctx.seed("torch"))
        gen = torch.Generator().manual_seed(ctx.seed("ldl-augment"))
        # the pseudo-distributions this round starts from, measured against the truth
        q0 = pseudo_distributions(model, node.x_u, recipe, weights, self.augment, gen)
        pseudo = ldl_measures(node.d_u.numpy(), q0.numpy()) if len(node.x_u) else {}
        q_fixed = q0 if recipe.pseudo == "snapshot" else None
        steps = self.num_steps(ctx.partition_id)
        use_u = recipe.uses_unlabelled and len(node.x_u) > 0
        b = self.cfg.client.batch_size
        lab_gen = torch.Generator().manual_seed(ctx.seed("ldl-labelled"))
        unl_gen = torch.Generator().manual_seed(ctx.seed("ldl-unlabelled"))
        lab = iterate_batches(len(node.x_l), b, lab_gen) if len(node.x_l) else None
        unl = iterate_batches(len(node.x_u), self.params.mu * b, unl_gen) if use_u else None
        opt = make_optimizer(model, self.cfg)
        for group in opt.param_groups:
            group["lr"] = self.cfg.client.lr * self.lr_factor(ctx.server_round)
        model.train()
        if self.sample_level_dp:
            return self._train_private(model, ctx, opt, weights, gen, q_fixed, pseudo, steps)
        sums = dict.fromkeys(("loss", *LOSS_KEYS, "kept"), 0.0)
        kept_steps = 0
        for _ in range(steps):
            il = next(lab) if lab is not None else torch.empty(0, dtype=torch.long)
            iu = next(unl) if unl is not None else None
            loss, parts = step_loss(model, node.x_l[il], node.d_l[il], node.x_u[iu] if iu is not None else None,
                                    recipe, weights, self.augment, gen, q_fixed[iu] if q_fixed is not None else None)
            if loss.requires_grad:  # every term switched off (e.g. unsup_weight=0 on an unlabelled-only node)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sums["loss"] += float(loss.detach())
            for k in LOSS_KEYS:
                sums[k] += parts[k]
            if math.isfinite(parts["kept"]):
                sums["kept"] += parts["kept"]
                kept_steps += 1
        metrics = {k: (v / steps if steps else 0.0) for k, v in sums.items() if k != "kept"}
        metrics["kept"] = sums["kept"] / kept_steps if kept_steps else 0.0
        metrics.update({f"pseudo_{k}": float(pseudo.get(k, math.nan)) for k in PSEUDO_TRAIN})
        metrics["steps"] = float(steps)
        n = (len(node.x_l) + (len(node.x_u) if use_u else 0)) if steps else 0
        return TrainResult({k: v.detach().clone() for k, v in model.state_dict().items()}, n, metrics)

    def _train_private(self, model: nn.Module, ctx: NodeContext, opt: torch.optim.Optimizer, weights: Weights,
                       gen: torch.Generator, q_fixed: torch.Tensor | None, pseudo: dict[str, float],
                       steps: int) -> TrainResult:
        """DP-SGD on the node's rows ``(x, target, labelled)``: labelled rows with their distributions,
        unlabelled rows with their round snapshot (pseudo_label) or a placeholder (q built in the loss)."""
        node, recipe = self.node(ctx.partition_id), self.recipe
        metrics = {f"pseudo_{k}": float(pseudo.get(k, math.nan)) for k in PSEUDO_TRAIN}
        if steps == 0:  # supervised on an unlabelled-only node
            zero = {k: 0.0 for k in ("loss", *LOSS_KEYS, "kept")}
            return TrainResult({k: v.detach().clone() for k, v in model.state_dict().items()}, 0,
                               {**zero, **metrics, "steps": 0.0})
        use_u = recipe.uses_unlabelled and len(node.x_u) > 0
        xs, ts, flags = [node.x_l], [node.d_l], [torch.ones(len(node.x_l))]
        if use_u:
            xs.append(node.x_u)
            ts.append(q_fixed if q_fixed is not None else torch.full_like(node.d_u, 1.0 / node.d_u.shape[1]))
            flags.append(torch.zeros(len(node.x_u)))
        data = (torch.cat(xs), torch.cat(ts).float(), torch.cat(flags))
        sums = dict.fromkeys((*LOSS_KEYS, "labelled", "unlabelled", "kept"), 0.0)

        def loss(module: nn.Module, batch: Any) -> torch.Tensor:
            x, target, flag = batch
            per, parts = per_example_loss(module, x, target, flag > 0.5, recipe, weights, self.augment, gen)
            with torch.no_grad():
                for k in LOSS_KEYS:
                    sums[k] += float(parts[k].sum())
                sums["labelled"] += float((flag > 0.5).sum())
                sums["unlabelled"] += float((flag < 0.5).sum())
                sums["kept"] += float((parts["unsup_kl"] > 0).sum())
            return per.sum() / max(len(x), 1)  # the batch mean (0 on an empty Poisson batch)

        out = self.dp_trainer(ctx.partition_id).train_round(model, opt, data, ctx, num_examples=len(data[0]),
                                                            loss=loss)
        per_row = {k: sums[k] / max(sums["labelled" if k.startswith("sup") else "unlabelled"], 1.0) for k in LOSS_KEYS}
        metrics.update({"loss": out.mean_loss, **per_row,
                        "kept": sums["kept"] / sums["unlabelled"] if sums["unlabelled"] else 0.0,
                        "steps": float(out.steps), **out.metrics})
        return TrainResult({k: v.detach().clone() for k, v in model.state_dict().items()}, len(data[0]), metrics)

    def evaluate(self, arrays: StateDict, ctx: NodeContext) -> EvalResult:
        """The six measures of the global model on the node's unlabelled rows (their truth is known offline)."""
        node = self.node(ctx.partition_id)
        p = predict(self._load(arrays), node.x_u)
        return EvalResult(len(node.x_u), ldl_measures(node.d_u.numpy(), p.numpy()) if len(node.x_u) else {})

    def evaluate_global(self, arrays: StateDict) -> dict[str, float]:
        """Test-set measures (six + Spearman/Kendall) and the same of the recipe's pseudo-distributions of the pool."""
        model, data, split = self._load(arrays), self.data, self.split
        out = ldl_measures(data.d[split.test], predict(model, torch.from_numpy(data.x[split.test])).numpy())
        if len(split.val):  # evaluation.validation_fraction > 0: what tuning selects on (never the test rows)
            val = ldl_measures(data.d[split.val], predict(model, torch.from_numpy(data.x[split.val])).numpy())
            out.update({f"val/{k}": v for k, v in val.items()})
        if self.sample_level_dp:  # eval/pseudo_* would read every node's private unlabelled rows on the server
            return out
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "ldl-eval-pseudo"))
        q = pseudo_distributions(model, torch.from_numpy(data.x[split.unlabelled]), self.recipe, self.params.weights,
                                 self.augment, gen)
        out.update({f"pseudo_{k}": v for k, v in ldl_measures(data.d[split.unlabelled], q.numpy()).items()})
        return out

    def setup_summary(self) -> dict[str, Any]:
        s, d = self.split, self.data.d
        entropy = float(-(d * np.log(np.maximum(d, 1e-12))).sum(1).mean() / np.log(d.shape[1]))
        return {"ldl.set": self.data.name, "ldl.num_labels": self.data.num_labels, "ldl.n_test": len(s.test),
                "ldl.n_labelled": len(s.labelled), "ldl.n_unlabelled": len(s.unlabelled),
                "ldl.normalised_entropy": round(entropy, 4), "ldl.mean_peak_mass": round(float(d.max(1).mean()), 4),
                "ldl.labelled_nodes": sum(len(r.labelled) > 0 for r in self.rows)}

    def setup_artifacts(self, out_dir: Path) -> list[Path]:
        from envs.plots import plot_label_histogram

        c = self.data.num_labels
        hist = np.stack([np.bincount(self.data.peak[r.unlabelled], minlength=c) for r in self.rows])
        lab = [len(r.labelled) for r in self.rows]
        title = f"unlabelled rows per node by peak label (labelled rows per node: {lab})"
        return [plot_label_histogram(hist, out_dir / "ldl_nodes.png", title)]

    # -- the run's report ---------------------------------------------------------------------------
    def final_report(self, history: "History", out_dir: Path | None) -> tuple[dict[str, float], list[Path]]:
        rounds = [r for r in history.records if r.round >= 1 and "eval/pseudo_spearman" in r.metrics]
        if not rounds:
            return {}, []
        metrics: dict[str, float] = {}
        for k in ("spearman", "kendall", "cosine", "intersection", "kl"):
            series = [r.metrics[f"eval/pseudo_{k}"] for r in rounds]
            metrics[f"ldl/pseudo_{k}_mean"] = float(np.mean(series))  # over rounds 1..R: the whole run's pseudo-labels
        files: list[Path] = []
        if out_dir is not None:
            files += self._plots(history, out_dir)
        return {k: v for k, v in metrics.items() if math.isfinite(v)}, files

    def _plots(self, history: "History", out_dir: Path) -> list[Path]:
        from matplotlib.figure import Figure

        from fedsim.metrics.plots import save

        title = (f"{self.params.method}: {self.data.name}, {self.params.labelled_ratio:.0%} labelled, "
                 f"{self.cfg.num_clients} node(s), seed {self.cfg.seed}")
        keys = [*MEASURES, *RANKS]
        fig = Figure(figsize=(14, 6.5), layout="constrained")
        for i, k in enumerate(keys):
            ax = fig.add_subplot(2, 4, i + 1)
            for prefix, label in (("eval/", "test"), ("eval/pseudo_", "pseudo-labels (unlabelled pool)")):
                pts = history.series(prefix + k)
                if pts:
                    ax.plot(*zip(*pts), marker=".", label=label)
            ax.set_title(k)
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
            if i == 0:
                ax.legend(fontsize=7)
        fig.suptitle(title)
        files = [save(fig, out_dir / "ldl_measures.png")]
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        ax = fig.add_subplot()
        for k in ("spearman", "kendall", "cosine", "intersection"):
            pts = history.series(f"eval/pseudo_{k}")
            if pts:
                ax.plot(*zip(*pts), marker=".", label=k)
        ax.set_xlabel("round")
        ax.set_ylabel("pseudo-labels vs truth")
        ax.set_title(f"pseudo-label quality: rank (Spearman, Kendall) vs similarity (Cosine, Intersection)\n{title}",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        files.append(save(fig, out_dir / "ldl_pseudo.png"))
        table = out_dir / "ldl_rounds.csv"
        cols = [f"eval/{k}" for k in keys] + [f"eval/pseudo_{k}" for k in keys]
        lines = [",".join(["round", *cols])]
        for r in history.records:
            if "eval/kl" in r.metrics:
                lines.append(",".join([str(r.round), *(f"{r.metrics.get(c, float('nan')):.6g}" for c in cols)]))
        table.write_text("\n".join(lines) + "\n")
        files.append(table)
        return files


__all__ = ["LDLLearner", "LDLParams", "RECIPES"]
