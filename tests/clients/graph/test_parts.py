"""The parts the ImGDA learner composes: the report's round selection and table, the optimiser-state
round trip of a node's training step, and the environment's roles and prototypes."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from clients.graph.environment import PROTO_COUNT, PROTO_SUM, GraphDAParams, GraphEnvironment, global_prototypes
from clients.graph.report import select_rounds, write_rounds_csv
from clients.graph.training import load_optimizer, optimizer_state
from fedsim import config as C


def test_select_rounds_takes_the_first_best_round_and_drops_non_finite_values() -> None:
    rows = [(1, {"eval/source_val_macro_f1": 0.5, "eval/target_micro_f1": 0.9, "eval/target_macro_f1": 0.1,
                 "eval/target_tail_f1": math.nan}),
            (2, {"eval/source_val_macro_f1": 0.7, "eval/target_micro_f1": 0.9, "eval/target_macro_f1": 0.3}),
            (3, {"eval/source_val_macro_f1": 0.7, "eval/target_micro_f1": math.nan, "eval/target_macro_f1": 0.2})]
    metrics, picks = select_rounds(rows, 2, "source_val")
    assert picks["source_val"][0] == 2 and picks["target_test"][0] == 1
    assert metrics["gda/target_macro_f1"] == 0.3 and metrics["gda/last/target_macro_f1"] == 0.2
    assert math.isclose(metrics["gda/selection_optimism"], 0.1 - 0.3)
    assert "gda/target_test/target_tail_f1" not in metrics  # NaN dropped
    assert select_rounds(rows, 2, "target_test")[0]["gda/target_macro_f1"] == 0.1


def test_rounds_table_has_one_line_per_round_and_blank_missing_values(tmp_path: Path) -> None:
    path = write_rounds_csv([(1, {"eval/b": 1.0, "eval/a": 2.0, "train/x": 3.0}), (2, {"eval/a": 4.0})],
                            tmp_path / "t.csv")
    assert path.read_text().splitlines() == ["round,eval/a,eval/b", "1,2.0,1.0", "2,4.0,"]


def test_optimizer_state_round_trips() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([w], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        (w ** 2).sum().backward()
        opt.step()
    state = optimizer_state(opt)
    assert set(state) == {"opt.0.step", "opt.0.exp_avg", "opt.0.exp_avg_sq"}
    fresh = torch.optim.Adam([torch.nn.Parameter(w.detach().clone())], lr=0.1)
    load_optimizer(fresh, state)
    assert all(torch.equal(state[k], v) for k, v in optimizer_state(fresh).items())
    load_optimizer(fresh, {})  # nothing to restore: left as is


def test_roles_and_prototypes_of_the_environment() -> None:
    cfg = C.load_config("imgda", [], {"clients": 3})
    env = GraphEnvironment(cfg, GraphDAParams())
    assert [env.roles(i) for i in range(3)] == [(0, False), (1, False), (None, True)] and env.num_sources == 2
    assert global_prototypes({}) is None
    assert global_prototypes({PROTO_SUM: torch.zeros(2, 3, 4), PROTO_COUNT: torch.zeros(3)}) is None
    sums = torch.arange(24.0).view(2, 3, 4)
    local, glob, seen = global_prototypes({PROTO_SUM: sums, PROTO_COUNT: torch.tensor([2.0, 0.0, 1.0])})
    assert seen.tolist() == [0, 2] and torch.equal(local[0], sums[0, 0] / 2) and torch.equal(glob[1], sums[1, 2])
