"""The baselines of CKA-RL's Table 1, as CompoNet's code defines them (``mikelma/componet``;
CKA-RL's ``experiments/atari/run_ppo.py`` methods ``Baseline`` and ``Finetune``).

* ``scratch`` (Baseline): every task trains a freshly initialised actor and critic; a copy of each
  task's actor is kept, and task j is evaluated with its own copy.
* ``ft1`` (FT-1): one actor fine-tuned through the whole stream; every task is evaluated with that
  single (latest) actor, so it forgets.
* ``ftn`` (FT-N): the same training as FT-1 (task k starts from task k-1's actor), but a copy per
  task is kept and task j is evaluated with its own copy: no forgetting, N times the memory.

The critic is re-initialised at every task for all of them (``reset_critic``), as the authors' code
loads the previous agent with ``load_critic=False``.  Arrays: ``actor`` (D,), and ``copies`` (N, D)
for ``scratch`` / ``ftn`` (row j written by the server after task j).

Not implemented: ProgNet (the issue's "if time allows"), PackNet, MaskNet, CReLUs, CompoNet, CbpNet.
"""

from __future__ import annotations

import torch
from torch import Tensor

from algorithms.ckarl.agent import Method, StateDict


class FineTune(Method):
    """FT-1: one actor, fine-tuned task after task."""

    name = "ft1"
    keeps_copies = False
    fresh_each_task = False

    def _init(self) -> StateDict:
        out = {"actor": self.fresh_actor(0)}
        if self.keeps_copies:
            out["copies"] = torch.zeros(self.layout.num_tasks, self.actor_mlp.numel)
        return out

    def begin_task(self, arrays: StateDict, k: int) -> StateDict:
        out = super().begin_task(arrays, k)
        if k > 0 and self.fresh_each_task:
            out["actor"] = self.fresh_actor(k)
        return out

    def trainable_keys(self, k: int) -> list[str]:
        return ["actor", "critic"]

    def actor(self, arrays: StateDict, k: int) -> Tensor:
        return arrays["actor"]

    def end_task(self, arrays: StateDict, k: int) -> StateDict:
        if not self.keeps_copies:
            return arrays
        copies = arrays["copies"].clone()
        copies[k] = arrays["actor"]
        return {**arrays, "copies": copies}

    def task_actor(self, arrays: StateDict, j: int, done: int) -> Tensor:
        if self.keeps_copies and j < done:
            return arrays["copies"][j]
        return arrays["actor"]

    def latest_actor(self, arrays: StateDict, done: int) -> Tensor:
        return arrays["actor"]

    def memory(self, arrays: StateDict, done: int) -> int:
        return self.actor_mlp.numel * (max(done, 1) if self.keeps_copies else 1)


class FineTuneN(FineTune):
    """FT-N: FT-1's training, one stored copy per task."""

    name = "ftn"
    keeps_copies = True


class Scratch(FineTune):
    """Baseline: a fresh actor per task, one stored copy per task."""

    name = "scratch"
    keeps_copies = True
    fresh_each_task = True
