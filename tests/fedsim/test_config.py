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
        ([], {"rounds": 0}, "rounds must be in [1, 100000] (an integer), got 0"),
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


# -- the one validation pass (fedsim/validation.py) -------------------------------------------------
from dataclasses import dataclass, field  # noqa: E402

from fedsim.validation import (  # noqa: E402
    Range,
    check_fields,
    check_interpolations,
    check_run_id,
    check_writable_dir,
    rng,
    text,
)


@dataclass
class _Leaf:
    x: float = rng("(0, 1e6]", 1.0)
    n: int = rng("[1, 10]", 1)
    opt: float | None = rng("[0, 1)", None)
    label: str = text("a", max_len=5, nonempty=True)


@dataclass
class _Tree:
    leaf: _Leaf = field(default_factory=_Leaf)
    by_id: dict = field(default_factory=dict)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (_Tree(_Leaf(x=float("inf"))), "leaf.x must be in (0, 1e6] (a finite number), got inf"),
        (_Tree(_Leaf(x=float("nan"))), "leaf.x must be in (0, 1e6] (a finite number), got nan"),
        (_Tree(_Leaf(x=0.0)), "leaf.x must be in (0, 1e6]"),
        (_Tree(_Leaf(n=11)), "leaf.n must be in [1, 10] (an integer), got 11"),
        (_Tree(_Leaf(opt=1.0)), "leaf.opt must be in [0, 1)"),
        (_Tree(_Leaf(label="")), "leaf.label must not be empty"),
        (_Tree(_Leaf(label="toolong")), "leaf.label is 7 characters long; shorten it to at most 5"),
        (_Tree(by_id={"3": _Leaf(n=0)}), "by_id.3.n must be in [1, 10]"),
    ],
)
def test_check_fields_walks_nested_dataclasses(tree, message) -> None:
    with pytest.raises(ConfigError) as err:
        check_fields(tree)
    assert str(err.value).startswith(message)


def test_check_fields_accepts_bounds_and_none() -> None:
    check_fields(_Tree(_Leaf(x=1e6, n=10, opt=None, label="abcde"), {"1": _Leaf(opt=0.0)}))
    assert Range.parse("[0, inf)").contains(1e300) and not Range.parse("[0, inf)").contains(float("inf"))
    assert Range.parse("[0, inf]", finite=False).contains(float("inf"))


def test_a_new_field_gets_validation_by_declaring_its_range(monkeypatch) -> None:
    """Declaring the range is all it takes: the generic pass of config.validate enforces it."""
    cfg = C.load_config("fedavg", ["engine.round_timeout_s=1e6"])  # the upper bound is allowed
    cfg.engine.round_timeout_s = 1e6 + 1
    with pytest.raises(ConfigError, match=r"engine.round_timeout_s must be in \(0, 1e6\]"):
        C.validate(cfg)


@pytest.mark.parametrize("value", ["${oc.env:HOME}", "x${env:A}y", "${oc.decode:'1'}", "${foo:bar}", "${ nope }"])
def test_resolvers_are_rejected(value) -> None:
    with pytest.raises(ConfigError, match="uses a resolver"):
        check_interpolations({"a": [value]}, "")


@pytest.mark.parametrize("value", ["${client.lr}", "${.sibling}", "${a.b[0]}", "plain", "\\${oc.env:X}", 3])
def test_plain_references_pass(value) -> None:
    check_interpolations(value, "k")


def test_plain_reference_resolves_and_a_missing_one_names_the_key(tmp_path) -> None:
    assert C.load_config("fedavg", ["client.momentum=0.5", "client.weight_decay=${client.momentum}"]
                         ).client.weight_decay == 0.5
    path = tmp_path / "x.yaml"
    path.write_text("client:\n  lr: ${nope}\n")
    with pytest.raises(ConfigError, match=r"key 'client.lr': Interpolation key 'nope' not found") as err:
        C.load_config(str(path))
    assert "\n" not in str(err.value)


def test_env_interpolation_never_reaches_the_config(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_SECRET_TOKEN", "s3cr3t")
    path = tmp_path / "leak.yaml"
    path.write_text("description: ${oc.env:FEDSIM_SECRET_TOKEN}\n")
    for load in (lambda: C.load_config(str(path)),
                 lambda: C.load_config("fedavg", ["description=${oc.env:FEDSIM_SECRET_TOKEN}"])):
        with pytest.raises(ConfigError) as err:
            load()
        assert "s3cr3t" not in str(err.value) and "pass the value itself" in str(err.value)


def test_non_utf8_and_directory_files_are_one_line(tmp_path) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        C.read_yaml(bad)
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(ConfigError, match="cannot read it"):
        C.read_yaml(tmp_path / "d.yaml")


def test_run_ids_and_writable_dirs(tmp_path) -> None:
    assert check_run_id("0123456789abcdef" * 2) == "0123456789abcdef" * 2
    for bad in ("", "abc", "0123456789ABCDEF" * 2, "../" + "a" * 29, "a" * 33):
        with pytest.raises(ConfigError, match="not an MLflow run id"):
            check_run_id(bad)
    check_writable_dir(tmp_path / "new" / "deeper", "engine.checkpoint_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the probe leaves nothing behind
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        check_writable_dir(tmp_path / "file" / "sub", "engine.checkpoint_dir")


def test_eps_and_noise_multiplier_together_is_an_error() -> None:
    from fedsim.cli import _apply_eps

    cfg = C.load_config("fedavg", ["privacy.noise_multiplier=1.0"])
    with pytest.raises(ConfigError, match="set either --eps or privacy.noise_multiplier"):
        _apply_eps(cfg, 3.0)
    assert cfg.privacy.noise_multiplier == 1.0  # the user's σ is not silently dropped


def test_client_eval_needs_client_test_data() -> None:
    with pytest.raises(ConfigError, match="data.client_test_fraction=0"):
        C.load_config("fedavg", ["data.client_test_fraction=0", "strategy.fraction_evaluate=0.5"])
    C.load_config("fedavg", ["data.client_test_fraction=0", "strategy.fraction_evaluate=0"])


@pytest.mark.timeout(120)
def test_calibration_at_the_epsilon_upper_bound_is_fast_and_holds() -> None:
    """--eps up to the declared maximum (1e3) calibrates in seconds (it hung before), and the bound holds."""
    import time

    from privacy.accounting import calibrate_noise, epsilon_for

    bound = C.PrivacyConfig.__dataclass_fields__["epsilon"].metadata["range"].high
    assert bound == 1e3
    start = time.monotonic()
    sigma = calibrate_noise(bound, 1e-5, 0.1, 100, "prv")
    assert time.monotonic() - start < 60
    assert 0 < sigma and epsilon_for(sigma, 0.1, 100, 1e-5, "rdp") <= bound
