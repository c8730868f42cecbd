"""One node's round of semi-supervised LDL (plain or sample-level DP-SGD) and the evaluations of a model.

:func:`start_round` takes the loaded global model: it seeds the round, measures the pseudo-distributions the node
starts from and builds the optimiser; :func:`train_local` / :func:`train_private` then run the steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from clients.ldl.environment import LDLEnvironment, NodeData
from clients.ldl.measures import ldl_measures
from clients.ldl.methods import Recipe, Weights, per_example_loss, predict, pseudo_distributions, step_loss
from clients.supervised import iterate_batches, make_optimizer
from fedsim.config import ClientConfig
from fedsim.contracts.learner import EvalResult, NodeContext, StateDict, TrainResult
from fedsim.seeding import derive_seed, seed_torch
from privacy.facade import PrivateTrainer

__all__ = ["LOSS_KEYS", "PSEUDO_TRAIN", "LocalRound", "evaluate_node", "evaluate_server", "lr_factor", "num_steps",
           "start_round", "state_of", "train_local", "train_private"]

#: The measures of the pseudo-distributions reported as train metrics (and ``eval/pseudo_*`` all eight).
PSEUDO_TRAIN = ("spearman", "kendall", "cosine", "intersection")
LOSS_KEYS = ("sup_kl", "sup_rank", "unsup_kl", "unsup_rank")


def state_of(model: nn.Module) -> StateDict:
    """A detached copy of the model's state."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def num_steps(client: ClientConfig, method: str, mu: int, node: NodeData) -> int:
    """Optimiser steps a round costs the node (the same for every method; 0 for supervised without labels)."""
    if method == "supervised" and len(node.x_l) == 0:
        return 0
    if client.local_steps is not None:
        return client.local_steps
    per_epoch = max(-(-len(node.x_u) // (mu * client.batch_size)), -(-len(node.x_l) // client.batch_size))
    return client.local_epochs * per_epoch


def lr_factor(schedule: str, server_round: int, rounds: int) -> float:
    """The round's learning-rate factor (FixMatch's cosine decay over the run's rounds, or 1)."""
    if schedule == "constant":
        return 1.0
    return math.cos(7 * math.pi * (server_round - 1) / (16 * rounds))


@dataclass
class LocalRound:
    """A node's round once started: the model in train mode, its optimiser and the starting pseudo-labels."""

    model: nn.Module
    node: NodeData
    recipe: Recipe
    weights: Weights
    env: LDLEnvironment
    gen: torch.Generator  # the augmentation draws
    opt: torch.optim.Optimizer
    q_fixed: torch.Tensor | None  # the round's snapshot of the pseudo-distributions (recipe.pseudo == "snapshot")
    pseudo: dict[str, float]  # the starting pseudo-distributions measured against the truth
    steps: int

    @property
    def uses_unlabelled(self) -> bool:
        """Whether the round trains on the node's unlabelled rows."""
        return self.recipe.uses_unlabelled and len(self.node.x_u) > 0

    def pseudo_metrics(self) -> dict[str, float]:
        """The ``pseudo_*`` train metrics."""
        return {f"pseudo_{k}": float(self.pseudo.get(k, math.nan)) for k in PSEUDO_TRAIN}


def start_round(model: nn.Module, node: NodeData, recipe: Recipe, weights: Weights, env: LDLEnvironment,
                ctx: NodeContext, steps: int, lr: float) -> LocalRound:
    """Seed the round, measure the pseudo-distributions it starts from, build the optimiser at ``lr``."""
    seed_torch(ctx.seed("torch"))
    gen = torch.Generator().manual_seed(ctx.seed("ldl-augment"))
    q0 = pseudo_distributions(model, node.x_u, recipe, weights, env.augment, gen)
    pseudo = ldl_measures(node.d_u.numpy(), q0.numpy()) if len(node.x_u) else {}
    q_fixed = q0 if recipe.pseudo == "snapshot" else None
    opt = make_optimizer(model, env.cfg)
    for group in opt.param_groups:
        group["lr"] = lr
    model.train()
    return LocalRound(model, node, recipe, weights, env, gen, opt, q_fixed, pseudo, steps)


def train_local(r: LocalRound, ctx: NodeContext, batch_size: int, mu: int) -> TrainResult:
    """``r.steps`` steps of ``batch_size`` labelled and ``mu × batch_size`` unlabelled rows, each pool cycled."""
    node, steps = r.node, r.steps
    lab_gen = torch.Generator().manual_seed(ctx.seed("ldl-labelled"))
    unl_gen = torch.Generator().manual_seed(ctx.seed("ldl-unlabelled"))
    lab = iterate_batches(len(node.x_l), batch_size, lab_gen) if len(node.x_l) else None
    unl = iterate_batches(len(node.x_u), mu * batch_size, unl_gen) if r.uses_unlabelled else None
    sums = dict.fromkeys(("loss", *LOSS_KEYS, "kept"), 0.0)
    kept_steps = 0
    for _ in range(steps):
        il = next(lab) if lab is not None else torch.empty(0, dtype=torch.long)
        iu = next(unl) if unl is not None else None
        loss, parts = step_loss(r.model, node.x_l[il], node.d_l[il], node.x_u[iu] if iu is not None else None,
                                r.recipe, r.weights, r.env.augment, r.gen,
                                r.q_fixed[iu] if r.q_fixed is not None else None)
        if loss.requires_grad:  # every term switched off (e.g. unsup_weight=0 on an unlabelled-only node)
            r.opt.zero_grad(set_to_none=True)
            loss.backward()
            r.opt.step()
        sums["loss"] += float(loss.detach())
        for k in LOSS_KEYS:
            sums[k] += parts[k]
        if math.isfinite(parts["kept"]):
            sums["kept"] += parts["kept"]
            kept_steps += 1
    metrics = {k: (v / steps if steps else 0.0) for k, v in sums.items() if k != "kept"}
    metrics["kept"] = sums["kept"] / kept_steps if kept_steps else 0.0
    metrics.update(r.pseudo_metrics())
    metrics["steps"] = float(steps)
    n = (len(node.x_l) + (len(node.x_u) if r.uses_unlabelled else 0)) if steps else 0
    return TrainResult(state_of(r.model), n, metrics)


def train_private(r: LocalRound, ctx: NodeContext, trainer: PrivateTrainer) -> TrainResult:
    """DP-SGD on the node's rows ``(x, target, labelled)``: labelled rows with their distributions,
    unlabelled rows with their round snapshot (pseudo_label) or a placeholder (q built in the loss)."""
    node, recipe = r.node, r.recipe
    metrics = r.pseudo_metrics()
    if r.steps == 0:  # supervised on an unlabelled-only node
        zero = {k: 0.0 for k in ("loss", *LOSS_KEYS, "kept")}
        return TrainResult(state_of(r.model), 0, {**zero, **metrics, "steps": 0.0})
    xs, ts, flags = [node.x_l], [node.d_l], [torch.ones(len(node.x_l))]
    if r.uses_unlabelled:
        xs.append(node.x_u)
        ts.append(r.q_fixed if r.q_fixed is not None else torch.full_like(node.d_u, 1.0 / node.d_u.shape[1]))
        flags.append(torch.zeros(len(node.x_u)))
    data = (torch.cat(xs), torch.cat(ts).float(), torch.cat(flags))
    sums = dict.fromkeys((*LOSS_KEYS, "labelled", "unlabelled", "kept"), 0.0)

    def loss(module: nn.Module, batch: Any) -> torch.Tensor:
        x, target, flag = batch
        per, parts = per_example_loss(module, x, target, flag > 0.5, recipe, r.weights, r.env.augment, r.gen)
        with torch.no_grad():
            for k in LOSS_KEYS:
                sums[k] += float(parts[k].sum())
            sums["labelled"] += float((flag > 0.5).sum())
            sums["unlabelled"] += float((flag < 0.5).sum())
            sums["kept"] += float((parts["unsup_kl"] > 0).sum())
        return per.sum() / max(len(x), 1)  # the batch mean (0 on an empty Poisson batch)

    out = trainer.train_round(r.model, r.opt, data, ctx, num_examples=len(data[0]), loss=loss)
    per_row = {k: sums[k] / max(sums["labelled" if k.startswith("sup") else "unlabelled"], 1.0) for k in LOSS_KEYS}
    metrics.update({"loss": out.mean_loss, **per_row,
                    "kept": sums["kept"] / sums["unlabelled"] if sums["unlabelled"] else 0.0,
                    "steps": float(out.steps), **out.metrics})
    return TrainResult(state_of(r.model), len(data[0]), metrics)


def evaluate_node(model: nn.Module, node: NodeData) -> EvalResult:
    """The six measures of the model on the node's unlabelled rows (their truth is known offline)."""
    p = predict(model, node.x_u)
    return EvalResult(len(node.x_u), ldl_measures(node.d_u.numpy(), p.numpy()) if len(node.x_u) else {})


def evaluate_server(model: nn.Module, env: LDLEnvironment, recipe: Recipe, weights: Weights) -> dict[str, float]:
    """Test-set measures (six + Spearman/Kendall), ``val/*`` on a validation split, and the same measures of
    the recipe's pseudo-distributions of the whole unlabelled pool (``pseudo_*``; not under DP)."""
    data, split = env.data, env.split
    out = ldl_measures(data.d[split.test], predict(model, torch.from_numpy(data.x[split.test])).numpy())
    if len(split.val):  # evaluation.validation_fraction > 0: what tuning selects on (never the test rows)
        val = ldl_measures(data.d[split.val], predict(model, torch.from_numpy(data.x[split.val])).numpy())
        out.update({f"val/{k}": v for k, v in val.items()})
    if env.sample_level_dp:  # eval/pseudo_* would read every node's private unlabelled rows on the server
        return out
    gen = torch.Generator().manual_seed(derive_seed(env.cfg.seed, "ldl-eval-pseudo"))
    q = pseudo_distributions(model, torch.from_numpy(data.x[split.unlabelled]), recipe, weights, env.augment, gen)
    out.update({f"pseudo_{k}": v for k, v in ldl_measures(data.d[split.unlabelled], q.numpy()).items()})
    return out
