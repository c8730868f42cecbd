"""Every random stream in fedsim is derived from one root seed plus a stream name and indices.

``derive_seed(root, "batches", round, partition)`` gives the same 63-bit integer on every machine,
process and engine, so the local and Flower engines draw identical numbers.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch


def _key(part: int | str) -> int:
    if isinstance(part, str):
        return zlib.crc32(part.encode())
    if part < 0:
        raise ValueError(f"seed components must be non-negative, got {part}")
    return int(part)


def derive_seed(root: int, *parts: int | str) -> int:
    """A deterministic 63-bit seed for the stream named by ``parts`` under ``root``."""
    seq = np.random.SeedSequence([_key(root), *(_key(p) for p in parts)])
    return int(seq.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def numpy_rng(root: int, *parts: int | str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(root, *parts))


def torch_generator(root: int, *parts: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(root, *parts))


def seed_everything(root: int, *parts: int | str) -> None:
    """Seed Python's, NumPy's and torch's global generators from one derived seed."""
    s = derive_seed(root, *parts)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
