"""RDumb: ETA (or Tent) periodically reset to the source model, with its params.

* ``rdumb`` — RDumb (Press et al., NeurIPS 2023): the benchmark's ``reset_after_num_updates``
  (``base.py``) on top of ETA (``cfgs/*/rdumb.yaml``: ``ADAPTATION: eata``, ``FISHER_ALPHA: 0``,
  ``RESET_AFTER_NUM_UPDATES: 1000``); ``base="tent"`` resets Tent instead.

RDumb counts ``forward_and_adapt`` calls (the benchmark's ``performed_updates``, which also
counts ETA's skipped steps); the periodic reset restores model, optimizer and EMA but not that
counter; ``reset()`` zeroes it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from clients.tta.methods.base import StateDict, _counter
from clients.tta.methods.eata import ETA, EATAParams, _check_eata
from clients.tta.methods.tent import Tent
from fedsim.errors import ConfigError


@dataclass
class RDumbParams(EATAParams):
    reset_after_num_updates: int = 1000
    base: str = "eata"  # the method that is reset: "eata" (benchmark's RDumb) or "tent"


class RDumb(ETA):
    """RDumb: ETA (or Tent) reset to the source model every ``reset_after_num_updates`` batches."""

    name = "rdumb"
    Params = RDumbParams

    def validate_params(self) -> None:
        _check_eata(self.params)
        n = self.params.reset_after_num_updates
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"reset_after_num_updates must be an integer >= 1, got {n!r}")
        if self.params.base not in ("eata", "tent"):
            raise ConfigError(f"rdumb base must be 'eata' or 'tent', got {self.params.base!r}")

    def init_state(self) -> None:
        super().init_state()
        self.performed_updates = 0

    def adapt(self, out: torch.Tensor) -> dict[str, float]:
        info = Tent.adapt(self, out) if self.params.base == "tent" else super().adapt(out)
        self.performed_updates += 1
        info["reset"] = 0.0
        if self.performed_updates % self.params.reset_after_num_updates == 0:
            self.optimizer.zero_grad()
            self._restore_source()
            self.ema_probs = None
            info["reset"] = 1.0
        return info

    def extra_state(self) -> StateDict:
        out = super().extra_state()
        out["performed_updates"] = torch.tensor(self.performed_updates, dtype=torch.int64)
        return out

    def extra_state_keys(self) -> set[str]:
        return super().extra_state_keys() | {"performed_updates"}

    def load_extra_state(self, state: Mapping[str, torch.Tensor]) -> None:
        super().load_extra_state(state)
        self.performed_updates = _counter(state, "performed_updates")
