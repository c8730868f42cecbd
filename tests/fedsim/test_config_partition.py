"""Issue #27: typed partition parameters; one the chosen partitioner does not use is an error."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedsim import config as C
from fedsim.cli import main
from fedsim.errors import ConfigError
from fedsim.plugins import BUILTINS

ROOT = Path(__file__).resolve().parents[2]
PATHOLOGICAL_ALPHA = ("data.partition.alpha: partitioner 'pathological' does not use it (it uses: "
                      "num_classes_per_partition); remove it or set data.partition.name=dirichlet (or inner_dirichlet)")


# ------------------------------------------------------------------ the table matches the registry


def test_field_usage_table_matches_what_envs_partition_registers() -> None:
    from envs.partition import USES

    assert set(USES) == set(C.PARTITION_PARAMS) == set(BUILTINS["partitioner"])
    assert all(mod == "envs.partition" for mod in BUILTINS["partitioner"].values())
    for name, uses in USES.items():
        assert set(uses) == set(C.PARTITION_PARAMS[name]), name
        for key in C.PARTITION_REQUIRED.get(name, ()):
            assert uses[key] is None, (name, key)  # required: no default


def test_partition_keys_are_every_field_but_name_and_default_to_none() -> None:
    fields = [f.name for f in dataclasses.fields(C.PartitionConfig)]
    assert fields[0] == "name" and tuple(fields[1:]) == C.PARTITION_KEYS
    assert all(getattr(C.PartitionConfig(), key) is None for key in C.PARTITION_KEYS)
    assert {k for uses in C.PARTITION_PARAMS.values() for k in uses} == set(C.PARTITION_KEYS)


class _Spy:
    """A PartitionConfig that records which fields are read."""

    def __init__(self, cfg: C.PartitionConfig) -> None:
        self._cfg, self.read = cfg, set()

    def __getattr__(self, key: str):  # noqa: ANN204
        self.read.add(key)
        return getattr(self._cfg, key)


SMALL = {
    "size": {"partition_sizes": [100] * 10},
    "distribution": {"distribution_array": np.ones((10, 2)).tolist()},
}


@pytest.mark.parametrize("name", sorted(C.PARTITION_PARAMS))
def test_each_partitioner_reads_only_the_fields_it_declares(name: str) -> None:
    from fedsim.registry import PARTITIONERS

    labels = np.random.default_rng(0).permutation(np.arange(1000) % 10)
    spy = _Spy(C.PartitionConfig(name=name, **SMALL.get(name, {})))
    parts = PARTITIONERS.get(name)(labels, 5 if name == "exponential" else 10, spy, 0)
    assert all(len(p) for p in parts)
    assert spy.read - {"name"} <= set(C.PARTITION_PARAMS[name]), spy.read


def test_validation_imports_neither_flower_datasets_nor_envs() -> None:
    code = ("import sys; from fedsim import config as C\n"
            "C.load_config('fedavg_digits', ['data.partition.name=inner_dirichlet', 'data.partition.size_law=linear'])\n"
            "try:\n    C.load_config('fedavg_digits', ['data.partition.alpha=0.3'])\n"
            "except Exception as e:\n    assert 'does not use it' in str(e)\n"
            "bad = [m for m in ('flwr_datasets', 'envs.partition', 'datasets') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# -------------------------------------------------------------------------------- unused = error


def test_unused_param_from_an_override_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError) as info:
        C.load_config("fedavg_digits", ["data.partition.alpha=0.3"])
    assert str(info.value) == PATHOLOGICAL_ALPHA


def test_cli_print_config_with_an_unused_param_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "fedavg_digits", "data.partition.alpha=0.3", "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"fedsim: error: {PATHOLOGICAL_ALPHA}" and "Traceback" not in captured.err
    assert "partition" not in captured.out


def test_unused_param_from_yaml_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text("data:\n  name: digits\n  partition:\n    name: shard\n    num_shards_per_partition: 2\n"
                    "    min_partition_size: 5\n")
    with pytest.raises(ConfigError, match=r"^data\.partition\.min_partition_size: partitioner 'shard' does not use "
                                          r"it \(it uses: num_shards_per_partition\); remove it or set "
                                          r"data\.partition\.name=dirichlet$"):
        C.load_config(str(path))


@pytest.mark.parametrize("name", ["iid", "linear", "square", "exponential"])
def test_a_partitioner_without_params_rejects_every_one(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"data\.partition\.alpha: partitioner '{name}' does not use it "
                                          r"\(it uses: none\)"):
        C.load_config("fedavg", [f"data.partition.name={name}", "data.partition.alpha=0.3"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.partition.name=size"], r"data\.partition\.partition_sizes: partitioner 'size' needs it"),
        (["data.partition.name=size", "data.partition.partition_sizes=[10,10]"],
         r"partition_sizes: 2 sizes for num_clients=20"),
        (["data.partition.name=distribution"], r"data\.partition\.distribution_array: partitioner 'distribution' needs it"),
        (["data.partition.name=inner_dirichlet", "data.partition.size_law=cubic"], r"size_law must be one of"),
        (["data.partition.name=inner_dirichlet", "data.partition.size_law=linear",
          f"data.partition.partition_sizes=[{','.join(['5'] * 20)}]"], r"either partition_sizes or size_law"),
        (["data.partition.name=dirichlet", "data.partition.num_shards_per_partition=3"],
         r"num_shards_per_partition: partitioner 'dirichlet' does not use it .* data\.partition\.name=shard$"),
        (["data.partition.name=pathological", "data.partition.alpha=0.3"], r"partitioner 'pathological' does not use"),
    ],
)
def test_partition_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        C.load_config("fedphoenix", overrides)  # dirichlet(alpha=0.3), 20 clients
    assert "\n" not in str(info.value)


# ------------------------------------------------- naming another partitioner drops the file's keys


def test_naming_another_partitioner_drops_the_files_keys_it_does_not_use() -> None:
    cfg = C.load_config("fedavg_digits", ["data.partition.name=dirichlet", "data.partition.alpha=0.1"])
    p = cfg.data.partition
    assert (p.name, p.alpha, p.num_classes_per_partition) == ("dirichlet", 0.1, None)
    iid = C.load_config("fedphoenix", ["data.partition.name=iid"]).data.partition  # a claim's ceiling
    assert iid.name == "iid" and all(getattr(iid, k) is None for k in C.PARTITION_KEYS)
    inner = C.load_config("fedphoenix", ["data.partition.name=inner_dirichlet"]).data.partition
    assert inner.alpha == 0.3  # a key the new partitioner uses is kept
    same = C.load_config("fedphoenix", ["data.partition.name=dirichlet"]).data.partition
    assert same.alpha == 0.3


def test_defaults_are_the_partitioners_own() -> None:
    from envs.partition import USES

    assert USES["dirichlet"] == {"alpha": 0.5, "min_partition_size": 10, "self_balancing": False}
    assert USES["pathological"] == {"num_classes_per_partition": 2}
    assert USES["shard"] == {"num_shards_per_partition": 2}


# ------------------------------------------------------------------------------------ sweeps, specs


def test_a_sweep_over_an_unused_key_fails_upfront() -> None:
    from fedsim import sweep as S
    from fedsim.reproduce import build_config, settings

    _, spec = S.load_sweep("fedavg_digits", grid=["eps=1,.inf", "data.partition.alpha=0.3,10"], seeds=1)
    with pytest.raises(ConfigError, match=r"^data\.partition\.alpha: partitioner 'pathological' does not use it"):
        [build_config(spec, s, 0) for s in settings(spec)]
    _, ok = S.load_sweep("fedavg_digits", grid=["data.partition.alpha=0.3,10"], seeds=1,
                         overrides=["data.partition.name=dirichlet", "data.partition.min_partition_size=5"])
    alphas = [build_config(ok, s, 0).data.partition.alpha for s in settings(ok)]
    assert alphas == [0.3, 10.0]


def test_every_experiment_file_loads() -> None:
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        if not C.is_central(str(path)):
            C.load_config(str(path))


@pytest.mark.parametrize("name", ["fedphoenix_quick", "fedphoenix", "fedavg_alpha"])
def test_claim_specs_with_a_partition_grid_build_every_config(name: str) -> None:
    from fedsim import reproduce as R

    spec = R.load_claim(name)
    jobs = [j for j in R.final_jobs(spec, R.settings(spec), {}) if j.seed == spec.seeds[0]]
    cfgs = [R.build_config(spec, j.setting, j.seed, j.extra) for j in jobs]
    assert {c.data.partition.name for c in cfgs} >= {"dirichlet"}
