"""One way to run a block of code with a given number of torch intra-op threads."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (``n <= 0``: leave torch's setting), then restore it.

    Engines use it so every engine does identical arithmetic; centralised methods use it because tiny
    models run fastest on one thread on a shared machine.  Nothing is set when the thread already runs
    ``n``: ``set_num_threads`` costs ~0.1 ms, 8% of a tiny client's round when paid per call.
    """
    before = torch.get_num_threads()
    if n <= 0 or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
