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


def seed_torch(seed: int) -> None:
    """``torch.manual_seed`` without its CPU-only cost: with CUDA not initialised, torch queues a lazy
    CUDA seeding call that records a stack trace (about 8 ms per call, measured); per-client seeding
    of thousands of clients pays that every round.  CUDA generators are seeded when CUDA is in use."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def seed_everything(root: int, *parts: int | str) -> None:
    """Seed Python's, NumPy's and torch's global generators from one derived seed."""
    s = derive_seed(root, *parts)
    random.seed(s)
    np.random.seed(s % 2**32)
    seed_torch(s)
