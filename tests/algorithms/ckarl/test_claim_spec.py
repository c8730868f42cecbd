"""The decisive CKA-RL claim spec (issue #30): a budget at which PPO from scratch learns every task.

At 61,440 steps per task scratch's worst task reached a greedy return of 359 (below the >= 400 bar of
the issue); CleanRL's PPO on CartPole needs ~200k steps for ~400.  The spec must keep that budget, a
whole number of PPO iterations, the from-scratch row the control compares with, and 5 paired seeds.
"""

from __future__ import annotations


def test_ckarl_quick_trains_each_task_long_enough_for_scratch_to_learn_it() -> None:
    from algorithms.ckarl.config import RLParams
    from fedsim.claim_protocol import read_configurations
    from fedsim.reproduce import build_config, load_claim, settings

    spec = load_claim("ckarl_quick")
    grid = settings(spec)
    assert read_configurations(spec, grid) == set(range(len(grid)))
    cfgs = [build_config(spec, setting, 0) for setting in grid]
    assert {c.client.params["method"] for c in cfgs} == {"ckarl", "ftn", "scratch"}
    for cfg in cfgs:
        p = RLParams(**cfg.client.params)
        assert p.steps_per_task >= 200_000 and p.steps_per_task % p.ppo.batch_size == 0
        assert cfg.rounds == len(p.tasks) * p.rounds_per_task
    (control,) = spec.controls.positive
    assert control.better == {"client.params.method": "ftn"} and control.worse == {"client.params.method": "scratch"}
    assert len(spec.seeds) == 5 and "rl/greedy_return_min" in spec.extra_metrics


def test_ckarl_critic_is_ckarl_quick_with_the_critic_kept_across_tasks() -> None:
    """The follow-up check differs from ckarl_quick only in ``reset_critic`` (for every method and the
    from-scratch reference), so its verdicts isolate the critic reset."""
    from fedsim.reproduce import build_config, load_claim, settings

    quick, critic = load_claim("ckarl_quick"), load_claim("ckarl_critic")
    assert critic.grid == quick.grid and critic.seeds == quick.seeds and critic.claim == quick.claim
    assert [o for o in critic.overrides if "reset_critic" not in o] == quick.overrides
    for a, b in zip(settings(quick), settings(critic)):
        qa, cb = build_config(quick, a, 0).client.params, build_config(critic, b, 0).client.params
        assert cb["reset_critic"] is False and qa.get("reset_critic", True) is True
        assert {k: v for k, v in cb.items() if k != "reset_critic"} == {k: v for k, v in qa.items() if k != "reset_critic"}
