"""The two methods without a gradient, and their (empty) params.

* ``source`` — no adaptation, eval mode (benchmark ``source.py``).
* ``bn_adapt`` — BN-1: test-batch statistics, no gradient (benchmark ``norm.py::BNTest``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clients.tta.methods.base import TTAMethod
from clients.tta.norm import use_batch_stats


@dataclass
class SourceParams:
    """``source`` takes no parameters."""


@dataclass
class BNAdaptParams:
    """``bn_adapt`` takes no parameters."""


class Source(TTAMethod):
    """No adaptation: the source model in eval mode."""

    name = "source"
    Params = SourceParams
    batch_stats = False

    def configure_model(self) -> None:
        self.model.eval()
        self.model.requires_grad_(False)

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        with torch.no_grad():
            out = self.model(x)
        self._check_logits(out)
        self.last_info = {}
        return out


class BNAdapt(Source):
    """BN-1: BatchNorm normalises with the test batch's statistics; no gradient."""

    name = "bn_adapt"
    Params = BNAdaptParams
    batch_stats = True

    def configure_model(self) -> None:
        super().configure_model()
        use_batch_stats(self.model)
