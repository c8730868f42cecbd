"""The DP facade (privacy/facade.py): any per-example loss over any tensors, the budget check and the
ledger metrics in one call; a loss function equal to the default criterion gives the same round."""

from __future__ import annotations

import copy

import pytest
import torch
from flwr.app import RecordDict
from torch import nn

from fedsim import config as C
from fedsim.contracts import NodeContext
from privacy.accounting import epsilon_for
from privacy.facade import DP_STATE, PrivacyBudgetExhausted, PrivateTrainer
from privacy.ledger import CLIENT_EPSILON, NOISE, SAMPLE_RATE, STEPS


def cfg() -> C.ExperimentConfig:
    c = C.load_config("fedavg_digits", ["privacy.enabled=true", "privacy.epsilon=2.0", "client.local_steps=2",
                                        "client.batch_size=16", "privacy.max_physical_batch_size=16"], {"rounds": 2})
    return c


def data(n: int = 80) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g), torch.randint(0, 2, (n,), generator=g)


def ctx(state: RecordDict | None = None, round_: int = 1) -> NodeContext:
    return NodeContext(partition_id=0, num_partitions=1, server_round=round_, root_seed=0, state=state if state is not None else RecordDict())


def test_a_loss_function_equal_to_the_criterion_gives_the_same_round() -> None:
    x, y, _ = data()
    torch.manual_seed(0)
    base = nn.Linear(5, 3)
    runs = []
    for loss in (None, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])):
        model = copy.deepcopy(base)
        out = PrivateTrainer(cfg()).train_round(model, torch.optim.SGD(model.parameters(), lr=0.5), (x, y), ctx(),
                                                num_examples=len(y), loss=loss)
        runs.append((model.weight.detach().clone(), out))
    (w_a, a), (w_b, b) = runs
    assert torch.equal(w_a, w_b) and a.metrics == b.metrics and a.steps == b.steps == 2
    assert not torch.equal(w_a, base.weight)


def test_any_per_example_loss_over_extra_tensors_and_the_ledger_metrics() -> None:
    """A third tensor (e.g. a task id) reaches the loss batch by batch; the reply carries the ledger keys."""
    x, y, task = data()
    model = nn.Linear(5, 3)
    seen: list[int] = []

    def loss(m: nn.Module, batch) -> torch.Tensor:
        xb, yb, tb = batch
        seen.append(len(tb))
        weight = 1.0 + tb.float()  # per-example weights: still a mean of per-example losses
        return (nn.functional.cross_entropy(m(xb), yb, reduction="none") * weight).mean()

    dp = PrivateTrainer(cfg())
    state = RecordDict()
    out = dp.train_round(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y, task), ctx(state),
                         num_examples=len(y), loss=loss)
    plan = dp.plan(0, len(y))
    assert seen and out.steps == plan.steps_per_round == 2
    assert int(state[DP_STATE]["steps"]) == 2
    assert out.metrics[STEPS] == 2 and out.metrics[SAMPLE_RATE] == plan.accounting_rate
    assert out.metrics[NOISE] == plan.noise_multiplier
    assert out.metrics[CLIENT_EPSILON] == pytest.approx(epsilon_for(plan.noise_multiplier, plan.accounting_rate, 2,
                                                                    1e-5, "prv"))


def test_budget_is_checked_before_training() -> None:
    x, y, _ = data()
    dp = PrivateTrainer(cfg())
    plan = dp.plan(0, len(y))
    model = nn.Linear(5, 3)
    before = model.weight.detach().clone()
    from flwr.app import MetricRecord

    state = RecordDict({DP_STATE: MetricRecord({"steps": plan.total_steps})})
    with pytest.raises(PrivacyBudgetExhausted, match="budget exhausted"):
        dp.train_round(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), ctx(state, 3), num_examples=len(y))
    assert torch.equal(model.weight, before)


def test_ghost_mode_refuses_a_loss_function() -> None:
    x, y, _ = data()
    c = cfg()
    c.privacy.grad_sample_mode = "ghost"
    model = nn.Linear(5, 3)
    with pytest.raises(ValueError, match="ghost needs an"):
        PrivateTrainer(c).train_round(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), ctx(),
                                      num_examples=len(y), loss=lambda m, b: m(b[0]).sum())
