"""The server's step: trainable keys from the average, everything global from the server, the pool push at
the end of a task."""

from __future__ import annotations

import torch

from algorithms.ckarl.config import RLParams, build_method
from algorithms.ckarl.node import server_update


def test_server_keeps_global_keys_and_pushes_at_task_end() -> None:
    p = RLParams(tasks=["plain", "swap", "plain"], rounds_per_task=2, steps_per_task=1024)
    m = build_method(p, 0)
    prev = m.end_task(m.init_arrays(), 0)
    noisy = {k: v + 1.0 for k, v in prev.items()}  # the nodes' average differs in every key
    mid = server_update(m, p, prev, noisy, server_round=3)  # task 1, first round
    for key in ("base", "pool", "pool_n", "slot_of", "task_beta"):
        assert torch.equal(mid[key], prev[key]), key  # theta_base and the pool are frozen after task 1
    for key in ("v", "beta", "critic"):
        assert torch.equal(mid[key], noisy[key]), key
    assert mid["round"].item() == 3.0 and m.pool_size(mid) == 1
    end = server_update(m, p, mid, {**noisy, "v": torch.full_like(prev["v"], 2.0)}, server_round=4)
    assert m.pool_size(end) == 2 and torch.equal(end["pool"][1], torch.full_like(prev["v"], 2.0))
    assert torch.equal(end["task_beta"][1], noisy["beta"])
    first = server_update(m, p, m.init_arrays(), noisy, server_round=1)  # task 0 trains theta_base
    assert torch.equal(first["base"], noisy["base"]) and torch.equal(first["v"], m.init_arrays()["v"])
