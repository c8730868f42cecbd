"""Sample-level DP-SGD for any learner, in one call: the plan, the budget check, the round and its
ledger entry live here, so a learner only says what its examples and its loss are.

    dp = PrivateTrainer(cfg)                                    # once per learner
    dp.plan(partition_id, num_examples)                         # the client's σ, rate, steps (cached)
    out = dp.train_round(model, optimizer, (x, y), ctx, num_examples=len(y))            # cross-entropy
    out = dp.train_round(model, optimizer, (x, y, task), ctx, num_examples=len(y),
                         loss=lambda module, batch: my_loss(module, *batch))            # any per-example loss
    metrics.update(out.metrics)                                 # what the server's ledger charges

The unit of privacy is one training example of one client: a row of the tensors given to
:meth:`PrivateTrainer.train_round` (Poisson-sampled, its gradient clipped and noised by Opacus).
Whatever the learner trains on outside those tensors is not protected, and the learner's
docstring must say so.  The loss must be a mean over the batch's examples with no term that
couples examples (no batch statistics); data-independent terms (FedProx's proximal pull) go in
``after_noise`` instead (see :func:`privacy.dp_sgd.private_local_training`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from flwr.app import MetricRecord
from torch import nn

from fedsim.config import ExperimentConfig
from privacy.accounting import epsilon_for
from privacy.dp_sgd import LossFn, private_local_training
from privacy.ledger import CLIENT_EPSILON, NOISE, SAMPLE_RATE, STEPS
from privacy.plan import ClientPrivacyPlan, plan_client

#: Per-node state record of the DP steps this client has spent (``ctx.state``).
DP_STATE = "dp-spent"


def round_seeds(ctx: Any) -> tuple[int, int]:
    """The seeds of a client round's Poisson batches and of its Gaussian noise."""
    return ctx.seed("dp-batches"), ctx.seed("dp-noise")


class PrivacyBudgetExhausted(RuntimeError):
    """The client's next round would take its ε past the target: it does not train."""


@dataclass
class PrivateRound:
    mean_loss: float
    steps: int  # logical DP-SGD steps taken (what the accountant counts)
    metrics: dict[str, float] = field(default_factory=dict)  # the ledger's keys, for the train reply


class PrivateTrainer:
    """One learner's sample-level DP-SGD (``privacy.level=sample``): plans, budget, rounds."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self._plans: dict[int, ClientPrivacyPlan] = {}

    @property
    def enabled(self) -> bool:
        return self.cfg.privacy.enabled and self.cfg.privacy.level == "sample"

    def plan(self, partition_id: int, num_examples: int) -> ClientPrivacyPlan:
        """The client's plan (σ calibrated so its ε ≤ target after every round); ConfigError if impossible."""
        if partition_id not in self._plans:
            self._plans[partition_id] = plan_client(partition_id, num_examples, self.cfg)
        return self._plans[partition_id]

    def spent_steps(self, ctx: Any) -> int:
        return int(ctx.state[DP_STATE]["steps"]) if DP_STATE in ctx.state else 0

    def check_budget(self, ctx: Any, plan: ClientPrivacyPlan) -> None:
        """Raise :class:`PrivacyBudgetExhausted` if another round would take this client past its ε."""
        p = self.cfg.privacy
        if p.epsilon is None:
            return
        eps_next = epsilon_for(plan.noise_multiplier, plan.accounting_rate, self.spent_steps(ctx) + plan.steps_per_round,
                               p.delta, p.accountant)
        if eps_next > p.epsilon * (1 + 1e-9):
            raise PrivacyBudgetExhausted(f"client {ctx.partition_id} privacy budget exhausted: another round "
                                         f"would reach ε={eps_next:.3f} > {p.epsilon}")

    def begin_round(self, ctx: Any, num_examples: int) -> ClientPrivacyPlan:
        """The client's plan for this round, after the budget check (:class:`PrivacyBudgetExhausted`)."""
        plan = self.plan(ctx.partition_id, num_examples)
        self.check_budget(ctx, plan)
        return plan

    def end_round(self, ctx: Any, plan: ClientPrivacyPlan, steps: int) -> dict[str, float]:
        """Record ``steps`` more DP-SGD steps in ``ctx.state``; the ledger metrics of the train reply."""
        p = self.cfg.privacy
        spent = self.spent_steps(ctx) + steps
        ctx.state[DP_STATE] = MetricRecord({"steps": spent})
        eps = epsilon_for(plan.noise_multiplier, plan.accounting_rate, spent, p.delta, p.accountant)
        return {STEPS: float(steps), SAMPLE_RATE: plan.accounting_rate, NOISE: plan.noise_multiplier,
                CLIENT_EPSILON: eps}

    def train_round(self, model: nn.Module, optimizer: torch.optim.Optimizer, data: tuple[torch.Tensor, ...],
                    ctx: Any, *, num_examples: int, loss: Optional[LossFn] = None,
                    criterion: Optional[nn.Module] = None,
                    after_noise: Optional[Callable[[], None]] = None) -> PrivateRound:
        """One round of DP-SGD on this client's examples ``data`` (tensors sharing their first dimension).

        ``loss(module, batch)`` is the mean per-example loss of a batch (a tuple like ``data``); the
        default is ``criterion`` (cross-entropy) of ``module(batch[0])`` against ``batch[1]``.  Records
        the steps in ``ctx.state`` and returns the ledger metrics of the reply.  (A cohort trained
        together, :mod:`clients.vectorised`, calls :meth:`begin_round` and :meth:`end_round` itself.)
        """
        plan = self.begin_round(ctx, num_examples)
        batch_seed, noise_seed = round_seeds(ctx)
        result = private_local_training(model, optimizer, data, privacy=self.cfg.privacy,
                                        batch_size=self.cfg.client.batch_size,
                                        steps=plan.steps_per_round, noise_multiplier=plan.noise_multiplier,
                                        batch_seed=batch_seed, noise_seed=noise_seed,
                                        loss=loss, criterion=criterion, after_noise=after_noise)
        return PrivateRound(result.mean_loss, result.steps, self.end_round(ctx, plan, result.steps))
