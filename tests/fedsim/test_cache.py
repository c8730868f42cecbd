"""The shared artefact cache: stable keys, atomic writes, build-once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsim.cache import cache_dir, cached_state, key_of


@dataclass
class _Spec:
    width: int = 8


def test_keys_are_stable_and_content_sensitive() -> None:
    assert key_of(_Spec(), "v1") == key_of(_Spec(), "v1")
    assert key_of(_Spec(8), "v1") != key_of(_Spec(9), "v1") != key_of(_Spec(8), "v2")


def test_cached_state_builds_once_then_loads(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path))
    calls = []

    def build() -> dict:
        calls.append(1)
        return {"w": torch.arange(4.0), "meta": {"epochs": 3}}

    path = cache_dir() / "models" / f"m-{key_of(_Spec())}.pt"
    first, cached1 = cached_state(path, build)
    second, cached2 = cached_state(path, build)
    assert (cached1, cached2) == (False, True) and len(calls) == 1
    assert torch.equal(first["w"], second["w"]) and second["meta"] == {"epochs": 3}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind
