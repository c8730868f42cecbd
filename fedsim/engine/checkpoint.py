"""Server checkpoints: everything a run needs to continue after a crash or a ``kill -9``.

Saved after every round (``engine.checkpoint``), under ``<engine.checkpoint_dir>/<mlflow run id>/``:

* ``state-<round>.safetensors`` — the global parameters and the strategy's array state, as
  safetensors (no pickle: loading a checkpoint cannot execute code);
* ``meta.json`` — the completed round, the config, the per-node states (Flower ``RecordDict``s as
  protobuf bytes, base64), the RNG states (Python, NumPy, torch), the round records so far, and the SHA-256 of the state file.

``meta.json`` is replaced atomically (``os.replace``) after the state file is complete, so a kill at
any moment leaves either the previous checkpoint or the new one, never a torn one.

Strategy state: every attribute of the strategy (and of a wrapped ``.strategy``) holding a Flower
``ArrayRecord`` (e.g. FedMut's previous global model) is saved and restored; everything else a
strategy holds is rebuilt from the config.  A strategy with other cross-round state implements
``checkpoint_state() -> dict[str, torch.Tensor]`` and ``restore_state(state)``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context

from fedsim.engine.history import RoundRecord
from fedsim.errors import ConfigError

META = "meta.json"
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
    """Write ``ckpt`` atomically (state file first, then ``meta.json`` by rename), drop older states."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {GLOBAL + k: v.detach().contiguous().clone() for k, v in ckpt.arrays.items()}
    tensors.update({STRATEGY + k: v.detach().contiguous().clone() for k, v in ckpt.strategy_state.items()})
    state_name = f"state-{ckpt.round}.safetensors"
    save_file(tensors, str(directory / state_name))
    meta = {"round": ckpt.round, "config_yaml": ckpt.config_yaml, "state_file": state_name,
            "keys": list(tensors),  # safetensors sorts names; state-dict order matters (e.g. FedMut's per-layer draws)
            "state_sha256": _sha256(directory / state_name), "rng": ckpt.rng,
            "node_states": {str(k): base64.b64encode(v).decode() for k, v in ckpt.node_states.items()},
            "records": [r.to_json() for r in ckpt.records]}
    tmp = directory / f"{META}.tmp"
    with tmp.open("w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / META)
    for old in directory.glob("state-*.safetensors"):
        if old.name != state_name:
            old.unlink(missing_ok=True)


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
        state_path = directory / meta["state_file"]
        if _sha256(state_path) != meta["state_sha256"]:
            raise ValueError(f"{state_path.name} does not match its recorded SHA-256")
        stored = load_file(str(state_path))
        tensors = {k: stored[k] for k in meta["keys"]}
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"the checkpoint in {directory} is damaged ({exc}); it cannot be resumed") from None
    return Checkpoint(
        round=int(meta["round"]), config_yaml=meta["config_yaml"],
        arrays={k[len(GLOBAL):]: v for k, v in tensors.items() if k.startswith(GLOBAL)},
        strategy_state={k[len(STRATEGY):]: v for k, v in tensors.items() if k.startswith(STRATEGY)},
        node_states={int(k): base64.b64decode(v) for k, v in meta["node_states"].items()},
        rng=meta["rng"], records=[RoundRecord.from_json(r) for r in meta["records"]])

