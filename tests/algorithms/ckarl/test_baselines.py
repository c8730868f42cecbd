"""Baselines' initialisation and storage rules, and the success / FWT protocol on curves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from algorithms.ckarl.agent import Layout
from algorithms.ckarl.baselines import FineTune, FineTuneN, Scratch
from algorithms.ckarl.evaluation import success_curve, tail_mean, training_curve
from algorithms.ckarl.report import RunCurves, curve_metrics, matrix_metrics, similar_tasks

LAYOUT = Layout(obs_dim=4, n_actions=2, hidden=8, num_tasks=3)


def _trained(m, a, k):
    a = m.begin_task(a, k)
    a["actor"] = a["actor"] + (k + 1)  # stands for training on task k
    return m.end_task(a, k)


@pytest.mark.parametrize("cls", [FineTune, FineTuneN, Scratch])
def test_task_start_rules_and_stored_copies(cls) -> None:
    m = cls(LAYOUT, 3)
    a = m.init_arrays()
    assert torch.equal(a["actor"], m.fresh_actor(0)) and torch.equal(a["critic"], m.fresh_critic(0))
    a = _trained(m, a, 0)
    start = m.begin_task(a, 1)
    assert torch.equal(start["critic"], m.fresh_critic(1))  # the critic restarts at every task (all methods)
    if cls is Scratch:
        assert torch.equal(start["actor"], m.fresh_actor(1))  # a fresh actor: the reference's own start
    else:
        assert torch.equal(start["actor"], a["actor"])  # FT-1 / FT-N continue from the previous task
    a = _trained(m, a, 1)
    for j in range(2):
        expected = a["copies"][j] if cls is not FineTune else a["actor"]
        assert torch.equal(m.task_actor(a, j, 2), expected)
    assert torch.equal(m.latest_actor(a, 2), a["actor"])
    if cls is not FineTune:
        assert not torch.equal(a["copies"][0], a["copies"][1])
        assert m.memory(a, 2) == 2 * m.actor_mlp.numel
    else:
        assert m.memory(a, 2) == m.actor_mlp.numel
    assert m.trainable_keys(1) == ["actor", "critic"]


def test_curves_fill_gaps_and_threshold_the_smoothed_return() -> None:
    np.testing.assert_array_equal(training_curve([np.nan, 10, np.nan, 30, np.nan]), [10, 10, 10, 30, 30])
    s = success_curve([0, 100, 100, 100], threshold=60, window=2)  # smoothed: 0, 50, 100, 100
    np.testing.assert_array_equal(s, [0, 0, 1, 1])
    assert tail_mean(np.arange(20.0)) == pytest.approx(18.5)  # the last 10%


def test_fwt_is_zero_against_itself_and_positive_for_a_head_start() -> None:
    ref = np.array([[10, 50, 100, 150, 200], [10, 50, 100, 150, 200]], dtype=float)
    same = curve_metrics(RunCurves(ref, ref, np.array([160.0, 160.0])), window=1)
    assert same["fwt"] == 0.0 and same["fwt_return"] == 0.0
    ahead = np.array([[10, 50, 100, 150, 200], [150, 200, 200, 200, 200]], dtype=float)
    m = curve_metrics(RunCurves(ahead, ref, np.array([160.0, 160.0])), window=1)
    # task 2: success 0,1,1,1,1 vs 0,0,0,0,1 -> AUC 0.875 vs 0.125 (trapezoid) -> (0.875-0.125)/(1-0.125)
    assert m["fwt"] == pytest.approx(0.75 / 0.875)
    assert m["fwt_return"] > 0 and m["init_return"] == 150.0 and m["init_return_ref"] == 10.0
    assert m["perf_train"] == 1.0


def test_fwt_splits_similar_and_conflicting_tasks_and_the_greedy_bar() -> None:
    """Similar = same conflict as the task before (only the physics changed): FT-N's positive control."""
    np.testing.assert_array_equal(similar_tasks(["plain", "plain", "swap", "swap", "plain"]),
                                  [False, True, False, True, False])
    ref = np.tile(np.array([10, 50, 100, 150, 200], dtype=float), (4, 1))
    run = ref.copy()
    run[1] = run[3] = 200.0  # a head start on the similar tasks
    run[2] = 10.0  # negative transfer on the conflicting one
    thr = np.full(4, 160.0)
    m = curve_metrics(RunCurves(run, ref, thr, similar_tasks(["plain", "plain", "swap", "swap"])), window=1)
    per = [m[f"task/{j}/fwt"] for j in range(4)]
    assert m["fwt_similar"] == pytest.approx((per[1] + per[3]) / 2) and m["fwt_similar"] > 0
    assert m["fwt_conflict"] == pytest.approx(per[2]) and m["fwt_conflict"] < 0
    assert m["fwt"] == pytest.approx(np.mean(per[1:]))
    assert m["fwt_return_similar"] > 0 > m["fwt_return_conflict"]
    R = np.array([[300.0, 20.0], [250.0, 410.0]])
    mm = matrix_metrics(np.ones((2, 2)), np.ones((2, 2)), R, R, None, greedy=np.array([480.0, 420.0]))
    assert mm["perf_return_min"] == 250.0 and mm["task/1/final_return"] == 410.0
    assert mm["greedy_return_min"] == 420.0 and mm["greedy_return"] == 450.0


@pytest.mark.parametrize("cls", [FineTune, FineTuneN, Scratch])
def test_reset_critic_false_carries_the_trained_critic_into_the_next_task(cls) -> None:
    """``reset_critic=false`` (the authors' ``load_critic=True``; issue #30: a fresh critic's advantages make
    PPO unlearn a fine-tuned policy on a similar task, ckarl_quick vs ckarl_critic): the critic a task ends
    with is the one the next task starts from; the actor follows the method's own rule either way."""
    kept, reset = cls(LAYOUT, 3, reset_critic=False), cls(LAYOUT, 3)
    a = _trained(kept, kept.init_arrays(), 0)
    a["critic"] = a["critic"] + 0.5  # stands for the critic trained on task 0
    start, fresh = kept.begin_task(a, 1), reset.begin_task(a, 1)
    assert torch.equal(start["critic"], a["critic"]) and torch.equal(fresh["critic"], reset.fresh_critic(1))
    assert torch.equal(start["actor"], fresh["actor"])
