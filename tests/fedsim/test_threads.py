"""torch_threads sets, leaves alone (n <= 0) and always restores torch's thread count."""

import pytest
import torch

from fedsim.threads import torch_threads


def test_sets_and_restores_even_on_error() -> None:
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with pytest.raises(RuntimeError), torch_threads(target):
        assert torch.get_num_threads() == target
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_zero_leaves_the_setting_alone() -> None:
    before = torch.get_num_threads()
    with torch_threads(0):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


def test_the_thread_count_already_set_is_not_set_again(monkeypatch) -> None:
    """set_num_threads costs ~0.1 ms; a client call under the count it already runs pays nothing."""
    calls: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    current = torch.get_num_threads()
    with torch_threads(current):
        assert torch.get_num_threads() == current
    assert calls == []
    other = 1 if current != 1 else 2
    with torch_threads(other):
        pass
    assert calls == [other, current]
