"""The ldl learner's parts on their own: step counts, the lr schedule, the run means and the report files."""

from __future__ import annotations

import math

import pytest
import torch

from clients.ldl.environment import NodeData
from clients.ldl.measures import MEASURES, RANKS
from clients.ldl.report import plots, pseudo_means
from clients.ldl.training import lr_factor, num_steps
from fedsim.config import ClientConfig
from fedsim.contracts.history import History, RoundRecord


def _node(n_l: int, n_u: int) -> NodeData:
    return NodeData(torch.zeros(n_l, 2), torch.zeros(n_l, 3), torch.zeros(n_u, 2), torch.zeros(n_u, 3))


def test_num_steps_is_one_pass_over_the_larger_pool() -> None:
    client = ClientConfig(batch_size=4, local_epochs=2)
    assert num_steps(client, "rankmatch", 2, _node(10, 20)) == 2 * 3  # ceil(10/4)=3 > ceil(20/8)=3
    assert num_steps(client, "rankmatch", 2, _node(4, 40)) == 2 * 5  # unlabelled pool: ceil(40/8)
    assert num_steps(client, "supervised", 2, _node(0, 40)) == 0  # nothing to train on
    assert num_steps(ClientConfig(batch_size=4, local_steps=7), "fixmatch", 2, _node(4, 40)) == 7


def test_lr_factor_cosine_and_constant() -> None:
    assert lr_factor("cosine", 1, 10) == 1.0
    assert lr_factor("cosine", 10, 10) == pytest.approx(math.cos(7 * math.pi * 9 / 160))
    assert lr_factor("constant", 5, 10) == 1.0


def _history(with_pseudo: bool) -> History:
    records = []
    for r in range(3):
        m = {f"eval/{k}": 0.5 + r for k in (*MEASURES, *RANKS)}
        if with_pseudo:
            m.update({f"eval/pseudo_{k}": float(r) for k in (*MEASURES, *RANKS)})
        records.append(RoundRecord(round=r, metrics=m))
    return History(records)


def test_pseudo_means_over_rounds_one_to_r() -> None:
    assert pseudo_means(_history(False)) is None
    means = pseudo_means(_history(True))
    assert means == {f"ldl/pseudo_{k}_mean": 1.5 for k in ("spearman", "kendall", "cosine", "intersection", "kl")}


def test_plots_write_figures_and_the_round_table(tmp_path) -> None:
    files = plots(_history(True), tmp_path, "title")
    assert [f.name for f in files] == ["ldl_measures.png", "ldl_pseudo.png", "ldl_rounds.csv"]
    lines = (tmp_path / "ldl_rounds.csv").read_text().splitlines()
    assert lines[0].startswith("round,eval/") and len(lines) == 4
