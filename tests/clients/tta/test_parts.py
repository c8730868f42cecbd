"""The parts of ``clients.tta.methods``: ETA's sample filters (entropy), each method module's own
params checks, the registry building every method from its module, and the re-exports."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import clients.tta as tta
from clients.tta.methods import TTA_METHODS, build_method
from clients.tta.methods.base import _as, _counter
from clients.tta.methods.entropy import eta_select, softmax_entropy
from fedsim.errors import ConfigError
from tests.clients.tta.test_methods import C, bn_net

pytestmark = pytest.mark.usefixtures("one_thread")

#: Method name -> the module of ``clients.tta.methods`` that defines it.
MODULE_OF = {"source": "source", "bn_adapt": "source", "tent": "tent", "eata": "eata", "rdumb": "rdumb",
             "lcotta": "lcotta"}


def test_eta_select_keeps_only_reliable_non_redundant_samples() -> None:
    # 0: confident class 0, 1: uniform (H = ln C > E0), 2: confident class 1.
    logits = torch.full((3, C), -8.0)
    logits[0, 0] = logits[2, 1] = 8.0
    logits[1] = 0.0
    ent = softmax_entropy(logits)
    e0 = 0.4 * math.log(C)
    keep, n_reliable, ema = eta_select(logits, ent, e0, 0.4, None, 0.9)
    assert keep.tolist() == [0, 2] and n_reliable == 2  # no EMA yet: only the reliability filter
    assert torch.allclose(ema, logits[[0, 2]].softmax(1).mean(0))
    # Against an EMA of class 0, sample 0 is redundant (|cos| ~ 1 >= d_margin): only 2 remains.
    m = torch.zeros(C)
    m[0] = 1.0
    keep, n_reliable, ema = eta_select(logits, ent, e0, 0.4, m, 0.9)
    assert keep.tolist() == [2] and n_reliable == 2
    assert torch.allclose(ema, 0.9 * m + 0.1 * logits[2].softmax(0))


@pytest.mark.parametrize(("module_name", "method_name", "field", "bad"), [
    ("tent", "Tent", "lr", -1.0),
    ("eata", "ETA", "d_margin", 0.0),
    ("rdumb", "RDumb", "reset_after_num_updates", 0),
    ("lcotta", "LCoTTA", "rank", 0),
])
def test_each_module_params_reject_a_bad_value(module_name, method_name, field, bad) -> None:
    module = importlib.import_module(f"clients.tta.methods.{module_name}")
    method = getattr(module, method_name)
    params = getattr(module, method.Params.__name__)
    method(bn_net(), C, params())  # the defaults pass
    with pytest.raises(ConfigError) as err:
        method(bn_net(), C, params(**{field: bad}))
    msg = str(err.value)
    assert field in msg and repr(bad) in msg and "\n" not in msg


@pytest.mark.parametrize("name", sorted(MODULE_OF))
def test_registry_builds_each_method_from_its_module(name) -> None:
    module = importlib.import_module(f"clients.tta.methods.{MODULE_OF[name]}")
    cls = TTA_METHODS[name]
    assert cls.__module__ == module.__name__ and getattr(module, cls.__name__) is cls
    assert cls.Params is getattr(module, cls.Params.__name__)  # params live beside their method
    method = build_method(name, bn_net(), C)
    assert type(method) is cls and method.name == name
    assert getattr(tta, cls.__name__) is cls and getattr(tta, cls.Params.__name__) is cls.Params


def test_state_helpers() -> None:
    like = torch.zeros(2, 3, dtype=torch.float64)
    v = torch.ones(2, 3)
    out = _as(v, like, "k")
    assert out.dtype == torch.float64 and torch.equal(out, v.double()) and out.data_ptr() != v.data_ptr()
    with pytest.raises(ConfigError, match=r"state 'k' has shape \(3,\), expected \(2, 3\)"):
        _as(torch.ones(3), like, "k")
    assert _counter({"n": torch.tensor(7)}, "n") == 7 and _counter({}, "n") == 0
