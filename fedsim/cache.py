"""On-disk cache for built artefacts (tokenizers, trained models), keyed by a content hash.

Everything that is trained once and reused (source models of the test-time regimes, pretrained
backbones of the centralised track) goes under :func:`cache_dir`; :func:`cached_state` is the one
load-or-build-and-save step they share.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch


def cache_dir() -> Path:
    """``$FEDSIM_CACHE`` or ``~/.cache/fedsim`` (created on first use)."""
    path = Path(os.environ.get("FEDSIM_CACHE") or Path.home() / ".cache" / "fedsim")
    path.mkdir(parents=True, exist_ok=True)
    return path


def key_of(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (dataclasses via ``vars``)."""
    text = json.dumps([vars(p) if hasattr(p, "__dataclass_fields__") else p for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and ``os.replace`` (concurrent builders are safe)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def cached_state(path: Path, build: Callable[[], Any]) -> tuple[Any, bool]:
    """``torch.load(path)`` if it exists, else ``build()`` saved atomically to ``path``; and whether it was cached.

    ``build`` returns anything ``torch.save`` stores and ``torch.load(weights_only=True)`` reads back
    (state dicts, nested dicts of tensors and numbers).
    """
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True), True
    state = build()
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())
    return state, False
