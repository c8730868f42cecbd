"""Config loading: typed merge, overrides, flags, and one-line errors that name the key."""

from __future__ import annotations

import pytest

from fedsim import config as C
from fedsim.errors import ConfigError


def test_builtin_experiment_loads_typed() -> None:
    cfg = C.load_config("fedavg")
    assert isinstance(cfg, C.ExperimentConfig)
    assert cfg.name == "fedavg" and cfg.data.name == "mnist" and cfg.num_clients == 10
    assert cfg.data.partition.name == "dirichlet" and cfg.data.partition.alpha == 0.5


def test_overrides_and_flags_map_to_keys() -> None:
    cfg = C.load_config("fedavg", ["data.partition.alpha=0.1", "client.lr=0.05"],
                        {"rounds": 5, "clients": 20, "seed": 3, "engine": "flower"})
    assert cfg.data.partition.alpha == 0.1 and cfg.client.lr == 0.05
    assert (cfg.rounds, cfg.num_clients, cfg.seed, cfg.engine.name) == (5, 20, 3, "flower")


@pytest.mark.parametrize(
    ("overrides", "flags", "needle"),
    [
        (["client.lrr=0.1"], {}, "client.lrr"),
        (["client.lr=abc"], {}, "client.lr"),
        (["rounds"], {}, "key=value"),
        ([], {"rounds": 0}, "rounds must be >= 1"),
        ([], {"engine": "gpu"}, "engine"),
        (["data.partition.alpha=-1"], {}, "data.partition.alpha"),
    ],
)
def test_bad_inputs_name_the_problem(overrides, flags, needle) -> None:
    with pytest.raises(ConfigError) as err:
        C.load_config("fedavg", overrides, flags)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_experiment_lists_known() -> None:
    with pytest.raises(ConfigError, match="known: .*fedavg"):
        C.load_config("no_such_experiment")


def test_yaml_file_errors(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    with pytest.raises(ConfigError, match="bad YAML at line"):
        C.load_config(str(bad))
    wrong_key = tmp_path / "wrong.yaml"
    wrong_key.write_text("data:\n  nme: mnist\n")
    with pytest.raises(ConfigError, match="data.nme"):
        C.load_config(str(wrong_key))
    wrong_type = tmp_path / "wrong_type.yaml"
    wrong_type.write_text("rounds: many\n")
    with pytest.raises(ConfigError, match="rounds"):
        C.load_config(str(wrong_type))


def test_yaml_path_experiment_named_after_file(tmp_path) -> None:
    path = tmp_path / "my_experiment.yaml"
    path.write_text("rounds: 2\nnum_clients: 3\ndata:\n  name: digits\n")
    cfg = C.load_config(str(path))
    assert cfg.name == "my_experiment" and cfg.rounds == 2 and cfg.data.name == "digits"


def test_roundtrip_and_flatten() -> None:
    cfg = C.load_config("fedavg", ["model.params.channels=[8,16]"])
    again = C.from_container(C.to_container(cfg))
    assert again == cfg
    flat = C.flatten(C.to_container(cfg))
    assert flat["data.partition.alpha"] == 0.5 and flat["model.params.channels"] == [8, 16]


def test_central_overrides_seed_and_params() -> None:
    cfg = C.load_central_config("spam_select", ["params.anything_new=3"], seed=7)
    assert cfg.seed == 7 and cfg.params["anything_new"] == 3
    assert "anything_new" not in C.load_central_config("spam_select").params


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [(["params"], "e.g. params.steps=100"), (["nosuch.key=1"], "no config key 'nosuch.key'"),
     (["seed=abc"], "seed")],
)
def test_central_bad_override_is_one_line(overrides, needle) -> None:
    with pytest.raises(ConfigError) as err:
        C.load_central_config("spam_select", overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)
