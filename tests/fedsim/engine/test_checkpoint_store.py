"""The checkpoint store: O(1) writes per round, torn appends ignored, version-1 files, the run lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedsim.engine import checkpoint as ckpt
from fedsim.contracts.history import RoundRecord
from fedsim.errors import ConfigError


def record(rnd: int) -> RoundRecord:
    metrics = {"eval/accuracy": 0.5 + rnd / 1000, "eval/loss": 1.0 / (rnd + 1), "train/loss": 0.25}
    clients = {p: {"train_loss": 0.1} for p in range(10)}
    return RoundRecord(rnd, metrics, seconds=0.1, clients_ok=10, client_metrics=clients)


def checkpoint(rnd: int, records: list[RoundRecord]) -> ckpt.Checkpoint:
    return ckpt.Checkpoint(round=rnd, config_yaml="seed: 0\n", arrays={"w": torch.full((4,), float(rnd))},
                           rng=ckpt.rng_states(), records=list(records))


def save_rounds(directory: Path, last: int) -> list[RoundRecord]:
    records = [record(0)]
    for rnd in range(1, last + 1):
        records.append(record(rnd))
        ckpt.save(directory, checkpoint(rnd, records))
    return records


def test_meta_json_stays_the_same_size_and_records_append_one_line_a_round(tmp_path) -> None:
    sizes, appended = {}, {}
    records = [record(0)]
    for rnd in range(1, 81):
        records.append(record(rnd))
        before = (tmp_path / ckpt.RECORDS).stat().st_size if rnd > 1 else 0
        ckpt.save(tmp_path, checkpoint(rnd, records))
        sizes[rnd] = (tmp_path / ckpt.META).stat().st_size
        appended[rnd] = (tmp_path / ckpt.RECORDS).stat().st_size - before
    assert max(sizes.values()) - min(sizes.values()) < 16  # only the digits of the round and counts change
    assert max(appended[r] for r in range(2, 81)) < 2 * len(json.dumps(record(80).to_json()))
    loaded = ckpt.load(tmp_path)
    assert loaded.round == 80 and [r.round for r in loaded.records] == list(range(81))
    assert loaded.records[-1] == records[-1]


@pytest.mark.parametrize("tail", [b'{"round": 4, "metrics": {"eval/acc', b'{"round": 4}\n', b"\x00\x00\x00"])
def test_a_torn_or_uncommitted_append_is_ignored_and_then_overwritten(tmp_path, tail: bytes) -> None:
    records = save_rounds(tmp_path, 3)
    with (tmp_path / ckpt.RECORDS).open("ab") as f:  # a save killed between the append and meta.json
        f.write(tail)
    loaded = ckpt.load(tmp_path)
    assert loaded.round == 3 and loaded.records == records
    records.append(record(4))
    ckpt.save(tmp_path, checkpoint(4, records))  # the resumed run's next save
    assert ckpt.load(tmp_path).records == records
    lines = (tmp_path / ckpt.RECORDS).read_bytes().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2, 3, 4]


def test_a_kill_before_meta_json_is_replaced_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    records = save_rounds(tmp_path, 2)

    def killed(*args, **kwargs):
        raise SystemExit("killed")

    monkeypatch.setattr(ckpt, "_replace_meta", killed)
    with pytest.raises(SystemExit):
        ckpt.save(tmp_path, checkpoint(3, [*records, record(3)]))
    loaded = ckpt.load(tmp_path)
    assert loaded.round == 2 and loaded.records == records
    assert torch.equal(loaded.arrays["w"], torch.full((4,), 2.0))


def test_records_shorter_than_committed_make_a_damaged_checkpoint(tmp_path) -> None:
    save_rounds(tmp_path, 2)
    path = tmp_path / ckpt.RECORDS
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ConfigError, match="is damaged"):
        ckpt.load(tmp_path)


def test_version_1_checkpoints_load_and_upgrade_on_the_next_save(tmp_path) -> None:
    records = save_rounds(tmp_path, 2)
    meta = json.loads((tmp_path / ckpt.META).read_text())
    del meta["version"]
    meta["records"] = [r.to_json() for r in records]  # the old layout: every record inline
    (tmp_path / ckpt.META).write_text(json.dumps(meta))
    (tmp_path / ckpt.RECORDS).unlink()
    assert ckpt.load(tmp_path).records == records
    records.append(record(3))
    ckpt.save(tmp_path, checkpoint(3, records))
    assert json.loads((tmp_path / ckpt.META).read_text())["version"] == ckpt.VERSION
    assert ckpt.load(tmp_path).records == records


def test_a_newer_format_is_refused_in_one_line(tmp_path) -> None:
    save_rounds(tmp_path, 1)
    meta = json.loads((tmp_path / ckpt.META).read_text())
    (tmp_path / ckpt.META).write_text(json.dumps({**meta, "version": ckpt.VERSION + 1}))
    with pytest.raises(ConfigError, match="newer fedsim") as err:
        ckpt.load(tmp_path)
    assert "\n" not in str(err.value)


def test_the_directory_appears_with_the_first_save(tmp_path) -> None:
    store = ckpt.CheckpointDir(tmp_path / "root" / "run1", "run1")
    assert not (tmp_path / "root").exists()
    store.save(checkpoint(1, [record(0), record(1)]))
    assert store.exists() and store.held
    assert (store.path / ckpt.LOCK).read_text().strip() == str(os.getpid())
    store.release()


HOLDER = """
import sys, time
from pathlib import Path
from fedsim.engine.checkpoint import CheckpointDir
held = CheckpointDir(Path(sys.argv[1]), "run1")  # kept: a collected CheckpointDir closes its lock
held.lock()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_live_holder_blocks_the_lock_and_a_kill_9_frees_it(tmp_path) -> None:
    directory = tmp_path / "run1"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"run run1 is still running \(pid {holder.pid}\); stop it first"):
            ckpt.CheckpointDir(directory, "run1").lock()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    store = ckpt.CheckpointDir(directory, "run1")
    store.lock()  # the OS dropped the dead holder's lock
    assert store.held
    store.release()
