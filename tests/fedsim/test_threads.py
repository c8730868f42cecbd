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
