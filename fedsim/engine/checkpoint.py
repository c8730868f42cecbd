"""Server checkpoints: everything a run needs to continue after a crash or a ``kill -9``.

Saved after every round (``engine.checkpoint``), under ``<engine.checkpoint_dir>/<mlflow run id>/``
(the directory is created by the first save, not before):

* ``state-<round>.safetensors`` — the global parameters and the strategy's array state, as
  safetensors (no pickle: loading a checkpoint cannot execute code);
* ``records.jsonl`` — the round records, one JSON object a line, appended (and fsync'd) one round at
  a time, so a round's write does not grow with the length of the run;
* ``meta.json`` — format version 2: the completed round, the config, the per-node states (Flower
  ``RecordDict``s as protobuf bytes, base64), the RNG states (Python, NumPy, torch), the SHA-256 of
  the state file, and how many records (and bytes) of ``records.jsonl`` belong to this checkpoint;
* ``lock`` — holds the live run's pid under an exclusive ``flock`` (see :class:`CheckpointDir`).

A save writes the state file, then appends the new records (after cutting ``records.jsonl`` back to
the committed length, so a torn or uncommitted tail from a killed save is dropped), then replaces
``meta.json`` atomically (``os.replace``).  ``meta.json`` is the commit: a kill at any moment leaves
either the previous checkpoint or the new one, and lines past the committed length are ignored on
load.  Version-1 checkpoints (records inline in ``meta.json``) still load; their next save writes
``records.jsonl``.

Strategy state: every attribute of the strategy (and of a wrapped ``.strategy``) holding a Flower
``ArrayRecord`` (e.g. FedMut's previous global model) is saved and restored; everything else a
strategy holds is rebuilt from the config.  A strategy with other cross-round state implements
``checkpoint_state() -> dict[str, torch.Tensor]`` and ``restore_state(state)``.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context

from fedsim.contracts.history import RoundRecord
from fedsim.errors import ConfigError

META = "meta.json"
RECORDS = "records.jsonl"
LOCK = "lock"
VERSION = 2  # meta.json format: 1 held the records inline, 2 counts the committed lines of records.jsonl
GLOBAL, STRATEGY = "global/", "strategy/"


@dataclass
class Checkpoint:
    """The server state after round ``round``."""

    round: int
    config_yaml: str
    arrays: dict[str, torch.Tensor]
    strategy_state: dict[str, torch.Tensor] = field(default_factory=dict)  # "<attr>/<key>" -> tensor
    node_states: dict[int, bytes] = field(default_factory=dict)  # node id -> RecordDict protobuf
    rng: dict[str, Any] = field(default_factory=dict)
    records: list[RoundRecord] = field(default_factory=list)


# -- strategy state ------------------------------------------------------------------------------
def _strategies(strategy: Any) -> list[tuple[str, Any]]:
    """The strategy and any strategies it wraps (Flower's DP wrappers keep theirs in ``.strategy``)."""
    out, prefix = [], ""
    while strategy is not None:
        out.append((prefix, strategy))
        inner = getattr(strategy, "strategy", None)
        strategy, prefix = (inner, prefix + "strategy.") if inner is not strategy else (None, prefix)
    return out


def strategy_state(strategy: Any) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for prefix, s in _strategies(strategy):
        if hasattr(s, "checkpoint_state"):
            state.update({f"{prefix}{k}": v for k, v in s.checkpoint_state().items()})
            continue
        for attr, value in vars(s).items():
            if isinstance(value, ArrayRecord):
                state.update({f"{prefix}{attr}/{k}": v for k, v in value.to_torch_state_dict().items()})
    return state


def restore_strategy_state(strategy: Any, state: dict[str, torch.Tensor]) -> None:
    for prefix, s in _strategies(strategy):
        mine = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix) and "." not in k[len(prefix):].split("/")[0]}
        if hasattr(s, "restore_state"):
            s.restore_state(mine)
            continue
        by_attr: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in mine.items():
            attr, name = key.split("/", 1)
            by_attr.setdefault(attr, {})[name] = value
        for attr, tensors in by_attr.items():
            setattr(s, attr, ArrayRecord(tensors))


# -- node states and RNGs ------------------------------------------------------------------------
def node_states(contexts: dict[int, Context]) -> dict[int, bytes]:
    from flwr.common.serde import recorddict_to_proto

    return {node: recorddict_to_proto(ctx.state).SerializeToString() for node, ctx in contexts.items()}


def restore_node_states(contexts: dict[int, Context], states: dict[int, bytes]) -> None:
    from flwr.common.serde import ProtoRecordDict, recorddict_from_proto

    for node, blob in states.items():
        if node in contexts:
            contexts[node].state = recorddict_from_proto(ProtoRecordDict.FromString(blob))


def rng_states() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state().tolist()}


def restore_rng_states(rng: dict[str, Any]) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))


# -- files -----------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(directory: Path, ckpt: Checkpoint) -> None:
    """Write ``ckpt``: state file, then the new records, then ``meta.json`` by rename (the commit)."""
    make_dir(directory)
    state_name, keys = _write_state(directory, ckpt)
    count, size = _append_records(directory, ckpt.records, _committed_records(directory))
    meta = {"version": VERSION, "round": ckpt.round, "config_yaml": ckpt.config_yaml, "state_file": state_name,
            "keys": keys,  # safetensors sorts names; state-dict order matters (e.g. FedMut's per-layer draws)
            "state_sha256": _sha256(directory / state_name), "rng": ckpt.rng,
            "node_states": {str(k): base64.b64encode(v).decode() for k, v in ckpt.node_states.items()},
            "records": {"file": RECORDS, "count": count, "bytes": size}}
    _replace_meta(directory, meta)
    for old in directory.glob("state-*.safetensors"):
        if old.name != state_name:
            old.unlink(missing_ok=True)


def _write_state(directory: Path, ckpt: Checkpoint) -> tuple[str, list[str]]:
    """Write the tensors of ``ckpt`` to ``state-<round>.safetensors``; return its name and key order."""
    from safetensors.torch import save_file

    tensors = {GLOBAL + k: v.detach().contiguous().clone() for k, v in ckpt.arrays.items()}
    tensors.update({STRATEGY + k: v.detach().contiguous().clone() for k, v in ckpt.strategy_state.items()})
    state_name = f"state-{ckpt.round}.safetensors"
    save_file(tensors, str(directory / state_name))
    return state_name, list(tensors)


def _committed_records(directory: Path) -> tuple[int, int]:
    """(records, bytes) of ``records.jsonl`` that the current ``meta.json`` commits; (0, 0) if none."""
    try:
        records = json.loads((directory / META).read_text()).get("records")
    except (OSError, ValueError):
        return 0, 0
    if isinstance(records, dict):
        return int(records["count"]), int(records["bytes"])
    return 0, 0  # none yet, or version 1 (inline): records.jsonl is written from the start


def _append_records(directory: Path, records: list[RoundRecord], committed: tuple[int, int]) -> tuple[int, int]:
    """Cut ``records.jsonl`` to its committed length, append ``records`` past it, fsync; return the new length."""
    count, size = committed if committed[0] <= len(records) else (0, 0)
    path = directory / RECORDS
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+b") as f:
        if os.fstat(fd).st_size < size:  # shorter than committed (removed by hand?): rewrite it whole
            count, size = 0, 0
        f.truncate(size)
        f.seek(size)
        f.write(b"".join(json.dumps(r.to_json()).encode() + b"\n" for r in records[count:]))
        f.flush()
        os.fsync(f.fileno())
        return len(records), f.tell()


def _replace_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``meta.json`` to a temporary file, fsync it, and rename it over the old one."""
    tmp = directory / f"{META}.tmp"
    with tmp.open("w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / META)


def exists(directory: Path) -> bool:
    return (directory / META).is_file()


def load(directory: Path) -> Checkpoint:
    """Read the checkpoint in ``directory``; a missing or damaged one is a one-line ConfigError."""
    from safetensors.torch import load_file

    meta_path = directory / META
    if not meta_path.is_file():
        raise ConfigError(f"no checkpoint in {directory} (was the run started with engine.checkpoint=false, "
                          f"or did it finish and remove it? set engine.keep_checkpoint=true to keep one)")
    try:
        meta = json.loads(meta_path.read_text())
        version = int(meta.get("version", 1))
        if version > VERSION:
            raise ValueError(f"format version {version}, written by a newer fedsim (this one reads up to {VERSION})")
        state_path = directory / meta["state_file"]
        if _sha256(state_path) != meta["state_sha256"]:
            raise ValueError(f"{state_path.name} does not match its recorded SHA-256")
        stored = load_file(str(state_path))
        tensors = {k: stored[k] for k in meta["keys"]}
        records = meta["records"] if version == 1 else _read_records(directory, meta["records"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"the checkpoint in {directory} is damaged ({exc}); it cannot be resumed") from None
    return Checkpoint(
        round=int(meta["round"]), config_yaml=meta["config_yaml"],
        arrays={k[len(GLOBAL):]: v for k, v in tensors.items() if k.startswith(GLOBAL)},
        strategy_state={k[len(STRATEGY):]: v for k, v in tensors.items() if k.startswith(STRATEGY)},
        node_states={int(k): base64.b64decode(v) for k, v in meta["node_states"].items()},
        rng=meta["rng"], records=[RoundRecord.from_json(r) for r in records])


def _read_records(directory: Path, committed: dict[str, Any]) -> list[dict[str, Any]]:
    """The committed lines of ``records.jsonl`` (anything after them is an uncommitted or torn append)."""
    with (directory / committed["file"]).open("rb") as f:
        data = f.read(int(committed["bytes"]))
    lines = data.splitlines()
    if len(data) != int(committed["bytes"]) or len(lines) != int(committed["count"]):
        raise ValueError(f"{committed['file']} is shorter than its {committed['count']} committed records")
    return [json.loads(line) for line in lines]


# -- the live run's directory and lock -----------------------------------------------------------
def make_dir(path: Path, attempts: int = 5) -> None:
    """``mkdir -p`` that survives another run removing an empty parent (its settle) at the same moment."""
    for attempt in range(attempts):
        try:
            path.mkdir(parents=True, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise


class CheckpointDir:
    """One run's checkpoint directory; the live run holds ``lock`` in it under an exclusive ``flock``.

    The operating system drops the lock when the holding process exits in any way (``kill -9``
    included), so a stale lock file never blocks a resume; a live holder does.
    """

    def __init__(self, path: Path, run_id: str) -> None:
        self.path = path
        self.run_id = run_id
        self._lock: Any = None  # the open lock file while this process holds it

    def exists(self) -> bool:
        return exists(self.path)

    def load(self) -> Checkpoint:
        return load(self.path)

    def save(self, checkpoint: Checkpoint) -> None:
        """Save ``checkpoint``; the first save creates the directory and takes the lock."""
        self.lock(wait_s=5.0)  # a concurrent --resume attempt holds it only for a moment
        save(self.path, checkpoint)

    @property
    def held(self) -> bool:
        return self._lock is not None

    def lock(self, wait_s: float = 0.0) -> None:
        """Hold the run's lock (creating the directory); a live holder elsewhere is a one-line ConfigError."""
        if self._lock is not None:
            return
        make_dir(self.path)
        f = (self.path / LOCK).open("a+")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    f.seek(0)
                    pid = f.read().strip() or "unknown"
                    f.close()
                    raise ConfigError(f"run {self.run_id} is still running (pid {pid}); stop it first") from None
                time.sleep(0.05)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock = f

    def release(self) -> None:
        """Drop the lock (closing the file releases the ``flock``)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None
