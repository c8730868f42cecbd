"""Test-time adaptation methods as plain-PyTorch plug-ins (online: predict, then adapt), one module each.

* :mod:`~clients.tta.methods.base` — the :class:`TTAMethod` contract (after the online TTA benchmark
  ``mariodoebler/test-time-adaptation``), its state helpers and the deviations common to all methods.
* :mod:`~clients.tta.methods.entropy` — the entropy maths: :func:`softmax_entropy`, ETA's filters
  (:func:`eta_select`, :func:`update_ema_probs`) and re-weighted loss (:func:`eta_loss`).
* :mod:`~clients.tta.methods.source` — ``source`` (no adaptation) and ``bn_adapt`` (BN-1).
* :mod:`~clients.tta.methods.tent` — ``tent``, the SGD base of the gradient methods.
* :mod:`~clients.tta.methods.eata` — ``eata`` (ETA/EATA).
* :mod:`~clients.tta.methods.rdumb` — ``rdumb`` (ETA or Tent with periodic resets).
* :mod:`~clients.tta.methods.lcotta` — ``lcotta`` (ETA with the update projected on a gradient subspace).
* :mod:`~clients.tta.methods.registry` — :data:`TTA_METHODS`, :func:`make_params`, :func:`build_method`.

Each method module holds its params dataclass, their checks and the method's documented deviations.
"""

from clients.tta.methods.base import StateDict, TTAMethod
from clients.tta.methods.eata import EATAParams, ETA
from clients.tta.methods.entropy import eta_loss, eta_select, softmax_entropy, update_ema_probs
from clients.tta.methods.lcotta import LCoTTA, LCoTTAParams
from clients.tta.methods.rdumb import RDumb, RDumbParams
from clients.tta.methods.registry import TTA_METHODS, build_method, make_params
from clients.tta.methods.source import BNAdapt, BNAdaptParams, Source, SourceParams
from clients.tta.methods.tent import Tent, TentParams

__all__ = [
    "TTA_METHODS", "BNAdapt", "BNAdaptParams", "EATAParams", "ETA", "LCoTTA", "LCoTTAParams", "RDumb",
    "RDumbParams", "Source", "SourceParams", "StateDict", "TTAMethod", "Tent", "TentParams", "build_method",
    "eta_loss", "eta_select", "make_params", "softmax_entropy", "update_ema_probs",
]
