"""Flower's stock Message-API strategies (strategies/flower_builtin.py): params derived from the Flower
constructors (pinned here, so a Flower upgrade that adds or drops an argument fails), one-line config
errors, and two rounds of every strategy on every engine."""

from __future__ import annotations

import dataclasses
import inspect
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.serverapp import strategy as flwr_strategy

from fedsim.engine import checkpoint as ckpt
from fedsim.engine.runtime import RunSpec
from fedsim.engine.server import build_strategy
from fedsim.errors import ConfigError
from fedsim.registry import STRATEGIES
from fedsim.runner import run_experiment
from strategies import flower_builtin as FB
from tests.strategies.util import tiny_cfg

#: The YAML params of each stock strategy, as Flower 1.42's constructors define them (name -> default).
PARAMS: dict[str, dict[str, object]] = {
    "fedadagrad": {"eta": 0.1, "tau": 1e-3},
    "fedadam": {"eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
    "fedyogi": {"eta": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
    "fedavgm": {"server_learning_rate": 1.0, "server_momentum": 0.0},
    "fedmedian": {},
    "fedtrimmedavg": {"beta": 0.2},
    "krum": {"num_malicious_nodes": 0},
    "multikrum": {"num_malicious_nodes": 0, "num_nodes_to_select": 1},
    "bulyan": {"num_malicious_nodes": 0},
    "qfedavg": {"q": 0.1},
}
#: Constructor arguments that are not params: set from the experiment, wire keys, callables.
SAMPLING = {"fraction_train", "fraction_evaluate", "min_train_nodes", "min_evaluate_nodes", "min_available_nodes"}
WIRE = {"weighted_by_key", "arrayrecord_key", "configrecord_key"}
METRIC_FNS = {"train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"}
NOT_PARAMS: dict[str, set[str]] = {
    **{n: SAMPLING | WIRE | METRIC_FNS | {"eta_l"} for n in ("fedadagrad", "fedadam", "fedyogi")},
    **{n: SAMPLING | WIRE | METRIC_FNS for n in ("fedavgm", "fedmedian", "fedtrimmedavg", "krum", "multikrum")},
    "bulyan": SAMPLING | WIRE | METRIC_FNS | {"selection_rule"},
    "qfedavg": SAMPLING | WIRE | METRIC_FNS | {"client_learning_rate", "train_loss_key"},
}
#: Flower strategies deliberately not registered (see the module docstring).
LEFT_OUT = {"FedXgbBagging", "FedXgbCyclic", "DifferentialPrivacyClientSideAdaptiveClipping",
            "DifferentialPrivacyClientSideFixedClipping", "DifferentialPrivacyServerSideAdaptiveClipping",
            "DifferentialPrivacyServerSideFixedClipping"}
OTHER_MODULES = {"FedProx": "fedprox"}  # registered elsewhere (strategies/fedprox.py)

#: Every strategy has a cohort of 4 (Krum needs n >= 2f+3, Bulyan n >= 4f+3).
FULL = ("strategy.fraction_train=1.0",)


def stock_cfg(name: str, *overrides: str, **kw):
    return tiny_cfg(name, *FULL, *overrides, **kw)


def build(name: str, *overrides: str):
    return build_strategy(RunSpec.from_config(stock_cfg(name, *overrides)))


def one_line_error(name: str, *overrides: str, match: str) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        build(name, *overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


# -- the registrations ------------------------------------------------------------------------------
def test_every_stock_flower_strategy_is_registered_or_deliberately_left_out() -> None:
    classes = {n for n, o in vars(flwr_strategy).items()
               if inspect.isclass(o) and issubclass(o, flwr_strategy.Strategy) and o is not flwr_strategy.Strategy}
    registered = {FB.STOCK[n].cls.__name__ for n in FB.STOCK} | {"FedAvg"} | set(OTHER_MODULES)
    assert classes == registered | LEFT_OUT
    assert set(FB.STOCK) == set(PARAMS)
    assert all(n == FB.STOCK[n].cls.__name__.lower() for n in FB.STOCK)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_params_are_the_flower_constructor_arguments(name: str) -> None:
    cls = FB.STOCK[name].cls
    signature = inspect.signature(cls).parameters
    assert set(signature) == set(PARAMS[name]) | NOT_PARAMS[name], "Flower's constructor changed: update PARAMS"
    assert {k: signature[k].default for k in PARAMS[name]} == PARAMS[name]
    entry = STRATEGIES.entry(name)
    assert entry.module == "strategies.flower_builtin" and entry.summary.startswith("Flower's")
    if not PARAMS[name]:
        assert entry.params is None
        return
    fields = {f.name: (f.type, f.default) for f in dataclasses.fields(entry.params)}
    assert fields == {k: (type(v), v) for k, v in PARAMS[name].items()}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_builds_with_defaults_and_experiment_sampling(name: str) -> None:
    strategy = build(name, "client.lr=0.07")
    assert isinstance(strategy, FB.STOCK[name].cls)
    assert (strategy.fraction_train, strategy.min_train_nodes, strategy.min_available_nodes) == (1.0, 4, 4)
    for key, value in PARAMS[name].items():
        assert getattr(strategy, key) == value, key
    if name == "qfedavg":
        assert strategy.client_learning_rate == 0.07
    if name.startswith(("fedada", "fedyogi")):
        assert strategy.eta_l == 0.07


def test_typed_params_reach_the_strategy() -> None:
    s = build("fedadam", "strategy.params.eta=0.05", "strategy.params.beta_1=0")
    assert (s.eta, s.beta_1, s.beta_2) == (0.05, 0.0, 0.99)
    assert build("multikrum", "strategy.params.num_nodes_to_select=3").num_nodes_to_select == 3


# -- config errors --------------------------------------------------------------------------------------
def test_unknown_or_mistyped_param_is_a_one_line_error() -> None:
    msg = one_line_error("fedadam", "strategy.params.nope=1", match=r"strategy\.params\.nope")
    assert "accepts: eta, beta_1, beta_2, tau" in msg
    one_line_error("fedmedian", "strategy.params.nope=1", match="takes no params")
    one_line_error("krum", "strategy.params.num_malicious_nodes=abc", match=r"strategy\.params\.num_malicious_nodes")


@pytest.mark.parametrize("name, overrides, match", [
    ("krum", ["strategy.params.num_malicious_nodes=1"],
     r"num_malicious_nodes=1 needs at least 2f\+3 = 5 clients.*4 clients"),
    ("multikrum", ["strategy.params.num_malicious_nodes=1"], "2f\\+3 = 5"),
    ("multikrum", ["strategy.params.num_nodes_to_select=5"], r"num_nodes_to_select=5 must be in 1..n-f = 1..4"),
    ("bulyan", ["strategy.params.num_malicious_nodes=1"], r"4f\+3 = 7 clients.*4 clients"),
    ("bulyan", ["strategy.fraction_train=0.5"], r"4f\+3 = 3 clients.*2 clients sampled per round"),
    ("krum", ["strategy.params.num_malicious_nodes=-1"], "must be >= 0"),
    ("fedtrimmedavg", ["strategy.params.beta=0.5"], r"beta=0.5 must be in \[0, 0.5\)"),
    ("fedadam", ["strategy.params.beta_2=1.0"], r"beta_2=1.0 must be in \[0, 1\)"),
    ("fedyogi", ["strategy.params.tau=0"], "tau=0.0 must be > 0"),
    ("fedavgm", ["strategy.params.server_momentum=1.5"], "server_momentum=1.5"),
    ("qfedavg", ["strategy.params.q=-1"], "q=-1.0 must be >= 0"),
])
def test_impossible_settings_are_one_line_errors_before_training(name: str, overrides: list[str], match: str) -> None:
    msg = one_line_error(name, *overrides, match=match)
    assert msg.startswith("strategy.params.")
    with pytest.raises(ConfigError, match=match):  # the runner's preflight, before any round
        run_experiment(stock_cfg(name, *overrides, rounds=1))


CLIENT_DP = ("privacy.enabled=true", "privacy.level=client", "privacy.noise_multiplier=1.0")


@pytest.mark.parametrize("name", sorted(set(PARAMS) - {"qfedavg"}))  # qfedavg refuses any DP, first
def test_client_level_dp_is_refused(name: str) -> None:
    """Its noise is calibrated for the uniform mean of the clipped updates (FedAvg); these aggregate
    otherwise, so they do not declare the mean_aggregation capability the DP layer asks for."""
    from fedsim.contracts.strategy import MEAN_AGGREGATION, declares

    assert not declares(build(name), MEAN_AGGREGATION)
    one_line_error(name, *CLIENT_DP, match="privacy.level=client calibrates its noise")


def test_client_level_dp_still_wraps_fedavg_and_qfedavg_refuses_any_dp() -> None:
    assert type(build("fedavg", *CLIENT_DP)).__name__ == "DifferentialPrivacyServerSideFixedClipping"
    one_line_error("qfedavg", "privacy.enabled=true", "privacy.noise_multiplier=1.0", match="train loss")


# -- end to end, local engine -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fedavg_run():
    return run_experiment(stock_cfg("fedavg", rounds=2))


def finite_rounds(result, rounds: int = 2) -> list[dict[str, float]]:
    rows = [r for r in result.history.as_rows() if r["round"] > 0]
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    for r in rows:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["eval/loss"]), r
        assert r["round/clients_ok"] == 4.0
    return rows


def same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", sorted(set(PARAMS) - {"fedavgm"}))
def test_two_rounds_on_the_local_engine_differ_from_fedavg(name: str, fedavg_run) -> None:
    result = run_experiment(stock_cfg(name, rounds=2))
    finite_rounds(result)
    assert not same_model(result.final_arrays, fedavg_run.final_arrays)
    assert not same_model(result.final_arrays, run_experiment(stock_cfg(name, rounds=1)).final_arrays)


def test_bulyan_short_of_4f_plus_3_replies_fails_the_round_instead_of_keeping_the_old_model() -> None:
    """Flower's Bulyan skips aggregation below 4f+3 valid replies with only a warning (the global model
    silently stays); its ``min_replies`` makes the engine fail the round like any shortfall."""
    from fedsim.contracts.strategy import MIN_REPLIES
    from fedsim.errors import RunFailedError

    assert getattr(build("bulyan"), MIN_REPLIES) == 3 and not hasattr(build("krum"), MIN_REPLIES)
    ok = run_experiment(stock_cfg("bulyan", "engine.faults.fail_partitions=[0]", rounds=1))
    assert [r["round/clients_ok"] for r in ok.history.as_rows() if r["round"] > 0] == [3.0]  # 3 = 4f+3, f=0
    with pytest.raises(RunFailedError, match="the strategy needs at least 3"):
        run_experiment(stock_cfg("bulyan", "engine.faults.fail_partitions=[0,1]", rounds=1))


def test_fedavgm_without_momentum_is_fedavg_and_with_momentum_is_not(fedavg_run) -> None:
    plain = run_experiment(stock_cfg("fedavgm", rounds=2))
    finite_rounds(plain)
    assert plain.history.as_rows() == fedavg_run.history.as_rows()
    assert same_model(plain.final_arrays, fedavg_run.final_arrays)
    momentum = run_experiment(stock_cfg("fedavgm", "strategy.params.server_momentum=0.9", rounds=2))
    finite_rounds(momentum)
    assert not same_model(momentum.final_arrays, fedavg_run.final_arrays)


def test_server_optimiser_state_round_trips_through_a_checkpoint(tmp_path) -> None:
    """FedOpt's moments (dicts of arrays) and FedAvgM's momentum (a list) are saved, not only ArrayRecords."""
    rng = np.random.default_rng(0)
    arrays = {"a.weight": rng.normal(size=(3, 2)).astype(np.float32), "b": np.float32(rng.normal(size=()))}
    adam, avgm = build("fedadam"), build("fedavgm", "strategy.params.server_momentum=0.9")
    adam.m_t, adam.v_t = dict(arrays), {k: v * 2 for k, v in arrays.items()}
    avgm.momentum_vector = list(arrays.values())
    avgm.current_arrays = ArrayRecord({k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()})
    for strategy, fresh in ((adam, build("fedadam")), (avgm, build("fedavgm", "strategy.params.server_momentum=0.9"))):
        ckpt.save(tmp_path, ckpt.Checkpoint(round=1, config_yaml="x: 1", arrays={"w": torch.ones(1)},
                                            strategy_state=ckpt.strategy_state(strategy), rng=ckpt.rng_states()))
        ckpt.restore_strategy_state(fresh, ckpt.load(tmp_path).strategy_state)
        for attr in ("m_t", "v_t", "momentum_vector"):
            if hasattr(strategy, attr):
                old, new = getattr(strategy, attr), getattr(fresh, attr)
                pairs = zip(old.values(), new.values()) if isinstance(old, dict) else zip(old, new)
                assert type(old) is type(new) and all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in pairs)
                assert (list(old) == list(new)) if isinstance(old, dict) else len(old) == len(new)
    assert fresh.current_arrays.keys() == avgm.current_arrays.keys()


def test_a_resumed_fedadam_run_equals_an_uninterrupted_one(in_tmp, tracking_uri) -> None:
    def tracked(*more: str, rounds: int):
        cfg = stock_cfg("fedadam", *more, rounds=rounds)
        cfg.tracking.enabled = True  # a resume finds its run in MLflow
        return cfg

    full = run_experiment(tracked(rounds=3), tracking_uri=tracking_uri)
    part = run_experiment(tracked("engine.keep_checkpoint=true", rounds=2), tracking_uri=tracking_uri)
    assert any(k.startswith("m_t:dict/") for k in ckpt.load(in_tmp / "fedsim-checkpoints" / part.run_id).strategy_state)
    resumed = run_experiment(tracked(rounds=3), tracking_uri=tracking_uri, resume_run_id=part.run_id)
    assert resumed.history.as_rows() == full.history.as_rows()
    assert same_model(resumed.final_arrays, full.final_arrays)


# -- end to end, every engine ---------------------------------------------------------------------------
RELAY, ROUNDS_EACH = "test_stock_relay", 2
ENGINE_OVERRIDES = {
    "local": ["engine.vectorise=false"],  # the per-client path: bit-identical to the other engines
    "ray": ["engine.ray.num_actors=2", "engine.ray.ray_num_cpus=2", "engine.checkpoint=false"],
    "flower": ["engine.flower.ray_num_cpus=2"],
}


class Relay:
    """Plays every stock strategy in turn, ``ROUNDS_EACH`` consecutive rounds each, each built by its
    registered builder: one engine start covers them all (a Ray start costs 10-20 s on 2 cores)."""

    def __init__(self, ctx, params) -> None:
        self.parts = [STRATEGIES.get(n)(ctx, STRATEGIES.params(n, {}, "strategy.params")) for n in sorted(PARAMS)]

    def _at(self, server_round: int):
        return self.parts[(server_round - 1) // ROUNDS_EACH]

    def configure_train(self, server_round, *args):
        return self._at(server_round).configure_train(server_round, *args)

    def aggregate_train(self, server_round, replies):
        return self._at(server_round).aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round, *args):
        return self._at(server_round).configure_evaluate(server_round, *args)

    def aggregate_evaluate(self, server_round, replies):
        return self._at(server_round).aggregate_evaluate(server_round, replies)


@pytest.fixture(scope="module")
def relay():
    STRATEGIES.register(RELAY, summary="test only: every stock strategy in turn")(Relay)
    yield lambda engine: run_experiment(stock_cfg(RELAY, f"engine.name={engine}", *ENGINE_OVERRIDES[engine],
                                                  rounds=ROUNDS_EACH * len(PARAMS)))
    del STRATEGIES._entries[RELAY]


@pytest.fixture(scope="module")
def local_relay(relay):
    result = relay("local")
    finite_rounds(result, ROUNDS_EACH * len(PARAMS))
    return result


def test_every_stock_strategy_plays_two_rounds_on_the_local_engine(local_relay) -> None:
    rows = [r for r in local_relay.history.as_rows() if r["round"] > 0]
    assert len({r["eval/loss"] for r in rows}) == len(rows)  # every round changed the model


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["ray", "flower"])
def test_every_stock_strategy_plays_two_rounds_on_each_engine_as_on_local(engine: str, relay, local_relay) -> None:
    result = relay(engine)
    finite_rounds(result, ROUNDS_EACH * len(PARAMS))
    assert result.history.as_rows() == local_relay.history.as_rows()
    assert same_model(result.final_arrays, local_relay.final_arrays)
