"""``engine.device``: where a learner keeps its model and data (``cpu``, ``cuda``, ``cuda:N`` or ``auto``).

``cpu`` (the default) gives the same numbers on every machine.  ``auto`` takes the first CUDA GPU
when torch sees one, else the CPU.  ``cuda``/``cuda:N`` is a one-line error where torch sees no such
GPU (the CPU build of torch, ``make install`` here, sees none: ``make install-gpu`` installs the CUDA
build of the same version).  The model, its optimiser state and the client's data live on the device
across rounds; only the arrays exchanged with the server are copied to the CPU (Flower's records
hold NumPy arrays).

Learners opt in with ``supports_device = True`` (:class:`fedsim.contracts.learner.Learner`); a
device other than the CPU for any other learner is refused before the run starts.  Under DP-SGD
the noise is drawn on the device from a generator seeded per client there (Opacus' own and the
vectorised cohort's, :mod:`privacy.cohort`), so a GPU run is reproducible but draws other noise
than a CPU run of the same seed; Poisson batches are drawn on the CPU either way.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fedsim.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a device is resolved, not when a config is checked
    import torch

#: The values ``engine.device`` accepts.
DEVICE_PATTERN = re.compile(r"cpu|auto|cuda(:\d+)?")


def check_device_name(name: str) -> None:
    if not isinstance(name, str) or not DEVICE_PATTERN.fullmatch(name):
        raise ConfigError(f"engine.device must be cpu, auto, cuda or cuda:N, got {name!r}")


def resolve_device(name: str) -> "torch.device":
    """The torch device ``engine.device`` names on this machine; ConfigError if there is no such GPU."""
    import torch

    check_device_name(name)
    if name == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if name == "auto":
        return torch.device("cuda" if available else "cpu")
    index = int(name.partition(":")[2] or 0)
    if not available:
        build = "the CPU build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise ConfigError(f"engine.device={name} but {build} sees no CUDA GPU; use engine.device=cpu or auto"
                          + (" (make install-gpu installs the CUDA build)" if torch.version.cuda is None else ""))
    if index >= torch.cuda.device_count():
        raise ConfigError(f"engine.device={name} but torch sees {torch.cuda.device_count()} CUDA GPU(s) "
                          f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def to_host(t: "torch.Tensor") -> "torch.Tensor":
    """A detached CPU copy of ``t`` (what a reply carries), from any device."""
    return t.detach().to("cpu", copy=True)
