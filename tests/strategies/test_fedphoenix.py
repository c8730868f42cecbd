"""FedPhoenix (strategies/fedphoenix.py): one reset seed per client, reproducible, keyed by the
canonical node position; plain FedAvg, step for step, once r_s rounds have passed; same history on
the local and Flower engines."""

from __future__ import annotations

import random

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedsim.contracts.wire import PHOENIX, PHOENIX_SEED, TRANSFORM_KEY
from fedsim.contracts.transforms import apply_transforms
from fedsim import config as C
from fedsim.engine.local import InProcessGrid, server_identity
from fedsim.engine.runtime import RunSpec, build_client_app, get_learner
from fedsim.engine.server import build_strategy
from fedsim.errors import ConfigError
from fedsim.models import build_model
from fedsim.runner import run_experiment
from fedsim.seeding import derive_seed
from flwr.serverapp.strategy import FedAvg
from strategies.fedphoenix import FedPhoenix
from tests.strategies.util import StubGrid, one_round, tiny_cfg

PHOENIX_OVERRIDES = ("strategy.params.theta=0.25", "strategy.params.reset_rounds=2")


def phoenix(root_seed: int = 0, reset_rounds: float = 3) -> FedPhoenix:
    return FedPhoenix(root_seed=root_seed, theta=0.25, reset_rounds=reset_rounds, total_rounds=6,
                      fraction_train=0.5, fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=6)


def train_messages(strategy, server_round: int, grid: StubGrid, arrays: ArrayRecord | None = None,
                   config: ConfigRecord | None = None):
    random.seed(123)  # the engine seeds the sampling; same seed, same sample for both strategies
    arrays = arrays if arrays is not None else ArrayRecord({"w": torch.zeros(2)})
    with server_identity(1):
        return list(strategy.configure_train(server_round, arrays, config if config is not None else ConfigRecord({}), grid))


def test_each_client_gets_its_own_seed_keyed_by_round_and_node_position() -> None:
    grid = StubGrid([907, 13, 4242, 8, 77, 3])  # raw ids are arbitrary; the list order is canonical
    msgs = train_messages(phoenix(), 2, grid)
    assert len(msgs) == 3
    seeds = [int(m.content["config"][PHOENIX_SEED]) for m in msgs]
    assert len(set(seeds)) == 3
    for m, s in zip(msgs, seeds):
        cfg = m.content["config"]
        assert cfg[TRANSFORM_KEY] == PHOENIX and cfg["server-round"] == 2
        assert s == derive_seed(0, "phoenix-reset", 2, grid.node_ids.index(m.metadata.dst_node_id))
    # rerun: the same seeds; another root seed or round: other seeds
    assert [int(m.content["config"][PHOENIX_SEED]) for m in train_messages(phoenix(), 2, grid)] == seeds
    assert not set(seeds) & {int(m.content["config"][PHOENIX_SEED]) for m in train_messages(phoenix(root_seed=1), 2, grid)}
    assert not set(seeds) & {int(m.content["config"][PHOENIX_SEED]) for m in train_messages(phoenix(), 3, grid)}


def test_two_clients_in_one_round_get_different_resets() -> None:
    model = build_model("cnn", {"channels": [8, 16], "hidden": 16}, (1, 8, 8), 10)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    msgs = train_messages(phoenix(), 1, StubGrid(list(range(6))))
    results = []
    for m in msgs[:2]:
        model.load_state_dict(init)
        apply_transforms(model, dict(m.content["config"]))
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    assert any(not torch.equal(results[0][k], results[1][k]) for k in init)
    for k in init:  # both changed only conv weights
        if not k.endswith(".weight") or init[k].dim() != 4:
            assert torch.equal(results[0][k], init[k]) and torch.equal(results[1][k], init[k])


def test_past_reset_rounds_the_messages_are_fedavg_messages() -> None:
    grid = StubGrid(list(range(6)))
    fedavg = FedAvg(fraction_train=0.5, fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=6)
    arrays = ArrayRecord({"w": torch.arange(3.0)})
    shared = ConfigRecord({})
    for server_round in (1, 2, 3, 4, 5):
        ours = train_messages(phoenix(reset_rounds=3), server_round, grid, arrays, shared)
        theirs = train_messages(fedavg, server_round, grid, arrays)
        assert [m.metadata.dst_node_id for m in ours] == [m.metadata.dst_node_id for m in theirs]
        configs = [dict(m.content["config"]) for m in ours]
        if server_round <= 3:  # rounds 1..r_s reset (the authors' 0-based round < r_s)
            assert all(c[TRANSFORM_KEY] == PHOENIX for c in configs)
        else:
            assert configs == [dict(m.content["config"]) for m in theirs] == [{"server-round": server_round}] * 3
        assert all(m.content["arrays"] is arrays for m in ours)  # one global model, never copied
        assert TRANSFORM_KEY not in shared  # per-client keys never leak into the shared round config


def test_after_reset_rounds_fedphoenix_is_fedavg_step_for_step() -> None:
    """Drive the rounds by hand: from FedPhoenix's own state, a FedAvg step gives exactly FedPhoenix's
    next state in every round after r_s = 2, and a different one in rounds 1..2."""
    cfg = tiny_cfg("fedphoenix", *PHOENIX_OVERRIDES, "strategy.fraction_train=0.5", rounds=4)
    spec = RunSpec.from_config(cfg)
    ours = build_strategy(spec)
    fedavg = build_strategy(RunSpec.from_config(tiny_cfg("fedavg", "strategy.fraction_train=0.5", rounds=4)))
    grid = InProcessGrid(build_client_app(spec), cfg.num_clients)
    with server_identity(1):
        states = [ArrayRecord(get_learner(spec).init_arrays())]
        for rnd in range(1, 5):
            states.append(one_round(ours, rnd, states[-1], grid, cfg.seed))
        for rnd in range(1, 5):
            step = one_round(fedavg, rnd, states[rnd - 1], grid, cfg.seed).to_torch_state_dict()
            same = all(torch.equal(step[k], v) for k, v in states[rnd].to_torch_state_dict().items())
            assert same == (rnd > 2), rnd


def test_zero_reset_rounds_is_fedavg_and_resets_show_in_the_history() -> None:
    fedavg = run_experiment(tiny_cfg("fedavg", rounds=3)).history.as_rows()
    none = run_experiment(tiny_cfg("fedphoenix", "strategy.params.theta=0.25", "strategy.params.reset_rounds=0",
                                   rounds=3)).history.as_rows()
    assert none == fedavg
    reset = run_experiment(tiny_cfg("fedphoenix", *PHOENIX_OVERRIDES, rounds=3)).history.as_rows()
    assert reset != fedavg
    # round 1 resets both conv layers (2 + 4 filters), round 2 only the deeper one (r_s = 2, L = 2)
    assert [r.get("train/reset_filters") for r in reset] == [None, 6.0, 4.0, None]
    assert [r.get("train/reset_layers") for r in reset] == [None, 2.0, 1.0, None]


def test_warns_when_theta_resets_no_filter(caplog) -> None:
    strategy = FedPhoenix(root_seed=0, theta=1 / 64, reset_rounds=3, total_rounds=6, fraction_train=0.5,
                          fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=6)
    with caplog.at_level("WARNING", logger="fedsim"):
        train_messages(strategy, 1, StubGrid(list(range(6))), ArrayRecord({"c.weight": torch.zeros(16, 1, 3, 3)}))
    assert any("resets no filter" in m for m in caplog.messages)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedsim"):
        train_messages(phoenix(), 1, StubGrid(list(range(6))), ArrayRecord({"c.weight": torch.zeros(64, 1, 3, 3)}))
    assert not any("resets no filter" in m for m in caplog.messages)


def test_bad_params_are_config_errors() -> None:
    for bad in ("strategy.params.theta=1.5", "strategy.params.distribution=zeros", "strategy.params.reset_rounds=-1"):
        with pytest.raises(ConfigError, match="strategy.params"):
            build_strategy(RunSpec.from_config(tiny_cfg("fedphoenix", bad)))


def test_default_reset_rounds_is_five_sixths_of_the_rounds() -> None:
    strategy = build_strategy(RunSpec.from_config(tiny_cfg("fedphoenix", rounds=12)))
    assert strategy.reset_rounds == pytest.approx(10.0) and strategy.theta == 1 / 64


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_and_flower_engines_give_the_same_fedphoenix_history() -> None:
    def cfg(engine: str) -> C.ExperimentConfig:
        c = tiny_cfg("fedphoenix", *PHOENIX_OVERRIDES, "engine.flower.ray_num_cpus=2", "strategy.fraction_train=0.5",
                     f"engine.name={engine}", rounds=2, clients=6)
        return c

    local = run_experiment(cfg("local"))
    flower = run_experiment(cfg("flower"))
    rows = local.history.as_rows()
    assert rows[1]["train/reset_filters"] == 6.0  # resets did happen
    assert flower.history.as_rows() == rows
    for key, value in local.final_arrays.items():
        assert torch.equal(flower.final_arrays[key], value), key
