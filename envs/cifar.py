"""CIFAR-10 read from a local directory in its standard *binary* format (never downloaded, never unpickled).

The user points ``data.params.root`` at the folder holding ``cifar-10-batches-bin/`` (or at that
folder itself), as unpacked from ``cifar-10-binary.tar.gz``::

    cifar-10-batches-bin/data_batch_1.bin ... data_batch_5.bin, test_batch.bin

Each file is a sequence of 3,073-byte records: one label byte (0-9), then 3,072 pixel bytes
(1,024 red, 1,024 green, 1,024 blue, each a 32x32 image in row-major order).  Only raw bytes are
read (``numpy.fromfile``), so loading a user's directory can never execute code, unlike the
Python-pickle version of the set.  The official batches hold 10,000 records each; any whole number
of records is accepted, so a test can build a tiny fixture.

With ``official_test`` (the default) the rows are the train batches then ``test_batch.bin``, and
:attr:`Cifar10Dataset.test_index` marks the test rows as the predefined server test split (the
paper's evaluation set; ``data.test_fraction`` is then unused).  Without it, the train batches (and,
with ``include_test``, the test batch) form one pool from which ``data.test_fraction`` is held out,
stratified, as for every dataset.  Pixels are scaled to [0, 1] and standardised per channel with the
usual CIFAR-10 statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.datasets import ArrayDataset
from fedsim.errors import ConfigError
from fedsim.registry import DATASETS

SUBDIR = "cifar-10-batches-bin"
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILE = "test_batch.bin"
IMAGE_BYTES = 3 * 32 * 32
RECORD_BYTES = 1 + IMAGE_BYTES
NUM_CLASSES = 10
#: Per-channel mean and std of the CIFAR-10 training images (on [0, 1] pixels).
MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)


@dataclass
class Cifar10Params:
    """Where the binary batches are, and which of them to use."""

    root: str = ""  # required: a directory holding cifar-10-batches-bin/ (or that directory itself)
    official_test: bool = True  # test_batch.bin is the server test split (else it joins the pool, see include_test)
    include_test: bool = True  # without official_test: add test_batch.bin to the pool the test split is drawn from
    max_images: int = 0  # > 0: keep the first N training records (a smaller run); 0 = all


@dataclass
class Cifar10Dataset(ArrayDataset):
    """An :class:`ArrayDataset` whose rows ``test_index`` (if set) are the predefined server test split."""

    test_index: np.ndarray | None = field(default=None)


def batches_dir(root: str) -> Path:
    """The directory holding the ``.bin`` batches under ``root``; ConfigError when there is none."""
    if not root:
        raise ConfigError("data.params.root is required for cifar10: a directory holding cifar-10-batches-bin/ "
                          "(e.g. data.params.root=/data/cifar10)")
    base = Path(root).expanduser()
    if not base.is_dir():
        raise ConfigError(f"data.params.root: {base} is not a directory")
    for candidate in (base / SUBDIR, base):
        if (candidate / TRAIN_FILES[0]).is_file():
            return candidate
    raise ConfigError(f"data.params.root: no {SUBDIR}/{TRAIN_FILES[0]} under {base} "
                      "(CIFAR-10 binary version, cifar-10-binary.tar.gz, unpacked)")


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) int64 of one binary batch file."""
    if not path.is_file():
        raise ConfigError(f"cifar10: missing batch file {path}")
    size = path.stat().st_size
    if size == 0 or size % RECORD_BYTES:
        raise ConfigError(f"cifar10: {path} has {size} bytes, not a whole number of {RECORD_BYTES}-byte records "
                          "(1 label byte + 3,072 pixel bytes); is it the binary version?")
    records = np.fromfile(path, dtype=np.uint8).reshape(-1, RECORD_BYTES)
    labels = records[:, 0].astype(np.int64)
    if labels.max() >= NUM_CLASSES:
        raise ConfigError(f"cifar10: {path} has label byte {int(labels.max())}; CIFAR-10 labels are 0-9")
    return records[:, 1:].reshape(-1, 3, 32, 32), labels


def _standardise(images: np.ndarray) -> np.ndarray:
    x = images.astype(np.float32) / 255.0
    return (x - MEAN[None, :, None, None]) / STD[None, :, None, None]


@DATASETS.register("cifar10", params=Cifar10Params,
                   summary="CIFAR-10 from a local directory, binary format (3x32x32, 10 classes; data.params.root)")
def load_cifar10(params: Cifar10Params | None, seed: int) -> Cifar10Dataset:
    """CIFAR-10 from ``params.root``: train rows then test rows; ``seed`` is unused (the order is the files')."""
    p = params or Cifar10Params()
    if p.max_images < 0:
        raise ConfigError(f"data.params.max_images must be >= 0, got {p.max_images}")
    folder = batches_dir(p.root)
    train = [read_batch(folder / name) for name in TRAIN_FILES]
    images = np.concatenate([x for x, _ in train])
    labels = np.concatenate([y for _, y in train])
    if p.max_images:
        images, labels = images[: p.max_images], labels[: p.max_images]
    test_index = None
    if p.official_test or p.include_test:
        test_x, test_y = read_batch(folder / TEST_FILE)
        if p.official_test:
            test_index = np.arange(len(labels), len(labels) + len(test_y), dtype=np.int64)
        images, labels = np.concatenate([images, test_x]), np.concatenate([labels, test_y])
    return Cifar10Dataset(_standardise(images), labels, NUM_CLASSES, "cifar10", test_index=test_index)
