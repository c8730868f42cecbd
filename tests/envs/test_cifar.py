"""CIFAR-10 from a local directory (binary batches) and the VGG-style CNN, on tiny fixtures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from envs.cifar import RECORD_BYTES, SUBDIR, TEST_FILE, TRAIN_FILES, Cifar10Params, load_cifar10
from fedsim.errors import ConfigError
from fedsim.models.vision import build_model
from fedsim.registry import DATASETS, MODELS


def write_cifar_fixture(root: Path, per_file: int = 20, seed: int = 0) -> Path:
    """Six binary batches of ``per_file`` random records (labels cycle 0-9) under root/cifar-10-batches-bin."""
    folder = root / SUBDIR
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, name in enumerate([*TRAIN_FILES, TEST_FILE]):
        records = rng.integers(0, 256, size=(per_file, RECORD_BYTES), dtype=np.uint8)
        records[:, 0] = (np.arange(per_file) + i) % 10
        records.tofile(folder / name)
    return folder


def test_records_decode_label_and_channel_planes(tmp_path: Path) -> None:
    folder = write_cifar_fixture(tmp_path, per_file=3)
    record = np.zeros(RECORD_BYTES, dtype=np.uint8)
    record[0] = 7
    record[1:1025] = 255  # red plane only
    record[1 + 1024 + 5] = 255  # one green pixel: row 0, column 5
    first = np.fromfile(folder / TRAIN_FILES[0], dtype=np.uint8).reshape(-1, RECORD_BYTES)
    first[0] = record
    first.tofile(folder / TRAIN_FILES[0])
    ds = load_cifar10(Cifar10Params(root=str(tmp_path)), seed=0)
    assert ds.input_shape == (3, 32, 32) and len(ds) == 18 and ds.num_classes == 10
    assert ds.y[0] == 7
    x0 = ds.x[0]
    assert np.allclose(x0[0], x0[0, 0, 0]) and x0[0, 0, 0] > 1.5  # red plane saturated, standardised
    assert x0[1, 0, 5] > 1.5 and x0[1, 0, 4] < 0 and x0[1, 1, 5] < 0  # the single green pixel, row-major
    assert np.all(x0[2] < 0)  # blue plane all zero


def test_registered_with_typed_params_and_options(tmp_path: Path) -> None:
    write_cifar_fixture(tmp_path, per_file=4)
    typed = DATASETS.params("cifar10", {"root": str(tmp_path / SUBDIR), "official_test": False,
                                        "include_test": False}, "data.params")
    assert isinstance(typed, Cifar10Params)
    ds = DATASETS.get("cifar10")(typed, 0)
    assert len(ds) == 4 * len(TRAIN_FILES) and ds.test_index is None  # the batch folder works as root too
    small = load_cifar10(Cifar10Params(root=str(tmp_path), max_images=7), 0)
    assert len(small) == 7 + 4 and list(small.test_index) == [7, 8, 9, 10]  # the test batch stays whole


def test_official_test_batch_is_the_server_test_split(tmp_path: Path) -> None:
    from envs.federated import build_federated_data

    write_cifar_fixture(tmp_path, per_file=20)
    data = build_federated_data({"name": "cifar10", "params": {"root": str(tmp_path)}, "partition": {"name": "iid"},
                                 "client_test_fraction": 0.0}, num_clients=4, seed=0)
    assert sorted(data.server_test_index) == list(range(100, 120))  # test_batch.bin's rows, not a stratified draw
    pooled = build_federated_data({"name": "cifar10", "params": {"root": str(tmp_path), "official_test": False},
                                   "partition": {"name": "iid"}, "test_fraction": 0.25}, num_clients=4, seed=0)
    assert len(pooled.server_test_index) == 30 and not set(pooled.server_test_index) <= set(range(100, 120))


@pytest.mark.parametrize("case, match", [
    ("no_root", "data.params.root is required"),
    ("not_dir", "is not a directory"),
    ("no_batches", "no cifar-10-batches-bin/data_batch_1.bin"),
    ("missing_test", "missing batch file .*test_batch.bin"),
    ("bad_size", "not a whole number of 3073-byte records"),
    ("bad_label", "label byte 12"),
])
def test_bad_directories_are_one_line_config_errors(tmp_path: Path, case: str, match: str) -> None:
    root = tmp_path / "data"
    root.mkdir()
    if case not in ("no_batches", "not_dir"):
        folder = write_cifar_fixture(root, per_file=2)
    if case == "missing_test":
        (folder / TEST_FILE).unlink()
    if case == "bad_size":
        with open(folder / TRAIN_FILES[2], "ab") as f:
            f.write(b"\x00" * 10)
    if case == "bad_label":
        raw = np.fromfile(folder / TRAIN_FILES[1], dtype=np.uint8)
        raw[0] = 12
        raw.tofile(folder / TRAIN_FILES[1])
    root_arg = {"no_root": "", "not_dir": str(tmp_path / "nope")}.get(case, str(root))
    with pytest.raises(ConfigError, match=match) as info:
        load_cifar10(Cifar10Params(root=root_arg), 0)
    assert "\n" not in str(info.value)


def test_vgg_shapes_width_and_norm() -> None:
    model = build_model("vgg", {"width": 0.125, "hidden": 16}, (3, 32, 32), 10)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 16, 32, 32, 64, 64, 64, 64]  # VGG-11 / 8
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert not any(isinstance(m, (torch.nn.BatchNorm2d, torch.nn.GroupNorm)) for m in model.modules())
    grouped = build_model("vgg", {"width": 0.125, "norm": "group", "groups": 8, "hidden": 0}, (3, 32, 32), 10)
    norms = [m for m in grouped.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(norms) == 8 and all(n.num_channels % n.num_groups == 0 for n in norms)
    assert grouped(torch.zeros(1, 3, 32, 32)).shape == (1, 10)
    assert "vgg" in MODELS.names()


def test_vgg_is_opacus_compatible() -> None:
    from opacus.validators import ModuleValidator

    for norm in ("none", "group"):
        model = build_model("vgg", {"width": 0.125, "norm": norm, "hidden": 16}, (3, 32, 32), 10)
        assert ModuleValidator.validate(model, strict=False) == []


@pytest.mark.parametrize("params, shape, match", [
    ({"width": 0}, (3, 32, 32), "width must be > 0"),
    ({"norm": "batch"}, (3, 32, 32), "norm must be one of"),
    ({}, (1, 8, 8), "at least 32x32"),
])
def test_vgg_bad_params(params: dict, shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_model("vgg", params, shape, 10)
